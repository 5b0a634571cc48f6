"""Ranks on hosts of their own: one process per ``hostnet`` host (tools/hostnet), joined by a rate-limited link.

Parent side: ``launch_on_hosts`` builds a ``HostNet`` (network namespaces
joined by veths limited to ``rate``), starts one Python process per host,
rank ``i`` in host ``i``, forwards their output line by line with a
``[hostI]`` prefix, and returns what each rank's worker returned. Everything
is torn down when it returns or raises (``HostNet`` kills what is left).

Rank side: ``python -m benchlib.hosts FILE FUNCTION CONFIG RESULT`` imports
the script ``FILE``, calls its module-level ``FUNCTION(cfg)`` with the JSON
in ``CONFIG`` and writes the (JSON-able) return value to ``RESULT``. The
process group comes from the environment as under torchrun: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` (host 0's address), ``MASTER_PORT``, and
``GLOO_SOCKET_IFNAME`` from ``HostNet.env`` (see [Note: what torchrun and gloo
need in a host] in ``tools/hostnet/__init__.py``).

Needs what ``HostNet`` needs (Linux, root, ``ip`` and ``tc``): ask
``hosts_available()`` first and skip, saying why, where it says no.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Callable

import hostnet
from local_ranks import die_with_parent

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASTER_PORT = 29500  # each net is private to one launch, so a fixed port cannot collide
_TAIL_LINES = 40  # of a rank's output, quoted when it fails


class HostRankError(RuntimeError):
    """A rank on a host failed or the launch timed out; carries the ranks' last output lines."""


def hosts_available() -> tuple[bool, str]:
    """Whether hosts can be made here (``hostnet.available()``), and why not."""
    return hostnet.available()


def launch_on_hosts(
    label: str,
    worker: Callable[[dict], Any],
    cfg: dict,
    *,
    rate: str,
    num_hosts: int = 2,
    timeout_s: float = 600.0,
    tag: str = "bench",
) -> list[Any]:
    """Runs ``worker(cfg)`` as rank ``i`` in host ``i`` of a fresh ``HostNet``; returns the results by rank.

    Args:
        label: what the phase is, for the progress lines.
        worker: a module-level function of a script or module (the ranks
            import its file again); ``cfg`` and its result must be JSON-able.
        cfg: its only argument.
        rate: every host's link rate in tc's notation (``"1gbit"``).
        num_hosts: hosts, one rank each. Default 2.
        timeout_s: the whole launch, from the first process started; then
            every rank is killed and ``HostRankError`` raised. Default 600.
        tag: prefix of the progress lines. Default ``bench``.
    """
    module = sys.modules[worker.__module__]
    worker_file = os.path.abspath(module.__file__ or "")
    print(f"[{tag}] {label}: {num_hosts} hosts at {rate} ...", flush=True)
    started = time.time()
    scratch = tempfile.mkdtemp(prefix="benchlib-hosts-")
    try:
        config_path = os.path.join(scratch, "config.json")
        with open(config_path, "w") as f:
            json.dump(cfg, f)
        with hostnet.HostNet(num_hosts=num_hosts, rate=rate) as net:
            results = _run_ranks(net, worker_file, worker.__name__, config_path, scratch, timeout_s)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"[{tag}] {label} done in {time.time() - started:.0f} s", flush=True)
    return results


def _rank_env(net: hostnet.HostNet, rank: int) -> dict[str, str]:
    # benchlib importable in the rank; what is already on PYTHONPATH (a
    # snapshot's src/, see snapshot.sh) stays first
    python_path = [p for p in (os.environ.get("PYTHONPATH", ""), BENCHMARKS) if p]
    return {
        **net.env(rank),
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(len(net.hosts)),
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": net.hosts[0].address,
        "MASTER_PORT": str(MASTER_PORT),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(python_path),
    }


def _run_ranks(
    net: hostnet.HostNet, worker_file: str, function: str, config_path: str, scratch: str, timeout_s: float
) -> list[Any]:
    result_paths = [os.path.join(scratch, f"result{rank}.json") for rank in range(len(net.hosts))]
    processes = []
    tails: list[collections.deque[str]] = []
    forwarders = []
    for rank, result_path in enumerate(result_paths):
        argv = [sys.executable, "-m", "benchlib.hosts", worker_file, function, config_path, result_path]
        process = net.run(
            rank, argv, env=_rank_env(net, rank), cwd=BENCHMARKS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        assert process.stdout is not None
        forwarder = threading.Thread(target=_forward, args=(f"[host{rank}] ", process.stdout, tail), daemon=True)
        forwarder.start()
        processes.append(process)
        tails.append(tail)
        forwarders.append(forwarder)
    # until all exit, one fails (the others would wait for it), or the time is up
    codes = hostnet.wait_all(processes, timeout_s)
    failed = next((rank for rank, code in enumerate(codes) if code), None)
    if failed is None and any(code is None for code in codes):
        failed = -1  # timed out
    if failed is not None:
        net.close()  # kills the others, which ends their output
        for forwarder in forwarders:
            forwarder.join(timeout=5)
        why = (
            f"timed out after {timeout_s:.0f} s"
            if failed < 0
            else f"rank {failed} exited with {processes[failed].returncode}"
        )
        quoted = "\n".join(f"--- rank {rank}, last lines:\n" + "".join(tail) for rank, tail in enumerate(tails))
        raise HostRankError(f"launch_on_hosts(): {why}\n{quoted}")
    for forwarder in forwarders:
        forwarder.join(timeout=5)
    results = []
    for path in result_paths:
        with open(path) as f:
            results.append(json.load(f))
    return results


def _forward(prefix: str, source: IO[bytes], tail: collections.deque[str]) -> None:
    for raw in iter(source.readline, b""):
        line = raw.decode(errors="replace")
        tail.append(line)
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def rank_main(argv: list[str]) -> int:
    """The rank's entry: ``FILE FUNCTION CONFIG RESULT`` (see the module docstring)."""
    worker_file, function, config_path, result_path = argv
    die_with_parent()
    name = os.path.splitext(os.path.basename(worker_file))[0]
    spec = importlib.util.spec_from_file_location(name, worker_file)
    assert spec is not None and spec.loader is not None, worker_file
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    with open(config_path) as f:
        cfg = json.load(f)
    result = getattr(module, function)(cfg)
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
