"""scripts/gpu_check.sh refuses, loudly, where no GPU is visible (it never skips its checks); its --cpu
run runs every check's body; a hanging check is killed and says where; a stopped run leaves what it found."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: gpu_check.sh would run the whole check")
def test_gpu_check_fails_without_a_gpu(tmp_path):
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")],
        env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "gpu_check: FAILED: no CUDA GPU is visible" in done.stdout, done.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["finished"] is True  # the summary says so too


def run_script(*args, out):
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), *args],
        env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=400,
    )


def test_the_dry_run_lists_every_check_within_the_budget_and_runs_the_cpu_preflight(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_check

    done = run_script("--dry-run", out=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for check in gpu_check.CHECKS:
        assert f"check {check.name}: {check.limit_s} s" in done.stdout
    assert gpu_check.PREFLIGHT_S + sum(c.limit_s for c in gpu_check.CHECKS) <= gpu_check.BUDGET_S < 300
    assert "PASS preflight" in done.stdout and "one gloo all-reduce" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "summary.json", "tracebacks.txt"]
    assert json.loads((tmp_path / "summary.json").read_text())["results"][0]["ok"] is True
    assert run_script("--dry-run", "no_such_check", out=tmp_path).returncode == 2


def test_a_failing_or_stuck_check_gives_its_errors_last_line_and_is_killed_at_its_limit():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_check

    ok, line, trace = gpu_check.in_own_process(["--one", "preflight:no_such_backend"], 60)
    assert not ok and "no_such_backend" in line and "\n" not in line
    assert "Traceback (most recent call last)" in trace  # the whole traceback goes to tracebacks.txt
    ok, line, _ = gpu_check.in_own_process(["--one", "preflight:gloo"], 1)  # importing torch takes longer
    assert not ok and line == "timed out after 1 s (killed)"
    assert gpu_check.last_line("Traceback ...\n  File x\nValueError: the point\n\n") == "ValueError: the point"


@pytest.mark.timeout(600)
def test_every_checks_body_runs_on_the_cpu_before_the_gpu_run(tmp_path):
    # --cpu: each body on the CPU with gloo and small models, in its own process, as on the GPU; the
    # three with nothing to run on a CPU say so. (The sync audit's counter failing on a planted read
    # in bucket.py's launch was checked by hand: "plain step 3: reads {'reducer/bucket.py (__float__)': 2}".)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_check

    done = run_script("--cpu", out=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    gpu_only = {c.name for c in gpu_check.CHECKS if c.gpu_only}
    assert gpu_only == {"memory", "pytest_cuda", "stall"}
    for check in gpu_check.CHECKS:
        assert f"{'N/A' if check.name in gpu_only else 'PASS'} {check.name}" in done.stdout, done.stdout
    assert "11 shapes, steady steps: host reads as expected" in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cpu"] is True and all(r["ok"] for r in summary["results"]), summary


def test_the_compile_verdict_wants_ddps_split_and_its_gradients_to_the_bit():
    # check_compile's verdict (scripts/gpu_checks.py): ours' compiled job against DDP's, bitwise, so that it
    # holds whichever kernels inductor picks on the machine; one ulp off in one gradient fails it
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_checks

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    ours, theirs = (gpu_checks.bn_model(16) for _ in range(2))
    for model in (ours, theirs):
        model(x).pow(2).mean().backward()
    line = gpu_checks.compiled_verdict(ours, theirs, (4, 4), "equal")
    assert line == "torch.compile: 4 graphs, gradients bitwise equal to DDP's compiled job"
    for graphs in ((1, 1), (1, 4), (4, 5)):  # no split; ours not split as DDP's
        with pytest.raises(AssertionError, match="not split at the buckets as DDP's"):
            gpu_checks.compiled_verdict(ours, theirs, graphs, "split")
    grad = next(ours.parameters()).grad
    grad[0, 0] = torch.nextafter(grad[0, 0], torch.tensor(float("inf")))  # one ulp
    with pytest.raises(AssertionError, match=r"0\.weight: one ulp: gradients against DDP's compiled job"):
        gpu_checks.compiled_verdict(ours, theirs, (4, 4), "one ulp")


def test_a_hanging_check_is_killed_at_its_limit_and_its_faulthandler_stack_says_where(tmp_path):
    # the hidden check "_hang" (scripts/gpu_check.py's TEST_CHECKS) sleeps in Python past its limit: its
    # process writes its stacks just before it is killed, to hang__hang.txt, and the line names the frame
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_check

    ok, line, trace = gpu_check.in_own_process(["--one", "_hang"], 10, str(tmp_path))
    assert not ok and line.startswith("timed out after 10 s (killed); stacks: its process at "), line
    assert line.endswith("scripts/gpu_checks.py:" + line.rsplit(":", 1)[1]) and "in hang_for_test" in line
    assert "-- faulthandler, hang__hang.txt:\nTimeout (" in trace and "in hang_for_test" in trace, trace
    assert "in hang_for_test" in (tmp_path / "hang__hang.txt").read_text()


def test_a_stopped_run_leaves_every_finished_checks_result_and_the_stacks_of_the_one_running(tmp_path):
    # --cpu _hang_rank _hang: the first hangs in its launched rank (killed by launch, which names it, after
    # the rank wrote its stacks); its result is on disk while the second runs, named as running; SIGTERM
    # (as scripts/gpu_check.sh's timeout sends) then stops the run: the running check is asked for its
    # stacks (SIGUSR1), killed and recorded as stopped
    command = [sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--cpu", "_hang_rank", "_hang"]
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")])
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        summary: dict = {}
        while time.monotonic() < deadline and not (tmp_path / "hang__hang.txt").exists():
            time.sleep(0.2)  # the second check's process has its faulthandler on once the file exists
            if (tmp_path / "summary.json").exists():
                summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary.get("running") == "_hang", summary
        time.sleep(0.5)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert [r["name"] for r in summary["results"]] == ["preflight", "_hang_rank"] and not summary["finished"]
    assert summary["results"][0]["ok"] and not summary["results"][1]["ok"], summary
    assert "stacks: rank 0 at scripts/gpu_checks.py:" in summary["results"][1]["line"], summary
    assert run.returncode == 1, out
    final = json.loads((tmp_path / "summary.json").read_text())
    assert final["finished"] and final["running"] is None, final
    assert final["results"][2] == {"name": "_hang", "ok": False, "line": "stopped: the run was stopped by SIGTERM"}
    assert "STOPPED _hang: the run was stopped by SIGTERM" in out, out
    tracebacks = (tmp_path / "tracebacks.txt").read_text()
    rank_part, own_part = tracebacks.split("== _hang\n")[0], tracebacks.split("== _hang\n")[1]
    assert "hang__hang_rank.rank0.txt:\nTimeout (" in rank_part and "in hang_for_test" in rank_part, tracebacks
    assert "hang__hang.txt:\n" in own_part and "in hang_for_test" in own_part, tracebacks
