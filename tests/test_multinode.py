"""Multi-node launch on one machine: torchrun across hosts made of network
namespaces (hostnet, in tools/), and the hosts themselves: teardown, rate,
reachability, the CLI.

Every test that makes hosts skips, saying why, where that cannot be done
(not root, no iproute2, no namespaces); each is bounded in time and leaves no
namespace behind, also when it fails.
"""

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hostnet
from hostnet import HostNet, NetSpec, netns, wait_all

REPO = Path(__file__).resolve().parents[1]
# The CLI runs as `python -m hostnet`, which needs tools/ on the child's PYTHONPATH.
CLI_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tools"), os.environ.get("PYTHONPATH")])),
}
CAN_MAKE_HOSTS, WHY_NOT = hostnet.available()
needs_hosts = pytest.mark.skipif(not CAN_MAKE_HOSTS, reason=f"cannot make hosts here: {WHY_NOT}")
PORT = 5201  # every net is private to its test, so a fixed port cannot collide

# A bounded TCP receiver and sender, run inside the hosts. The receiver times
# from its first byte to the sender's close, so set-up is not counted.
RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
server.settimeout(20)
connection, _ = server.accept()
connection.settimeout(20)
received, first = 0, None
while chunk := connection.recv(1 << 20):
    first = first or time.perf_counter()
    received += len(chunk)
print(received, time.perf_counter() - first)
"""
SENDER = """
import socket, sys, time
for _ in range(100):  # until the receiver listens, 5 s at most
    try:
        connection = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        break
    except OSError:
        time.sleep(0.05)
else:
    raise SystemExit("no receiver")
remaining, block = int(sys.argv[3]), bytes(1 << 20)
while remaining > 0:
    connection.sendall(block[: min(remaining, len(block))])
    remaining -= min(remaining, len(block))
connection.close()
"""


def live_namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True)
    return {line.split(" ", 1)[0] for line in listing.stdout.splitlines()}


def root_links() -> set[str]:
    listing = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10, check=True)
    return {line.split(":")[1].strip().split("@")[0] for line in listing.stdout.splitlines()}


def transfer(net: HostNet, sender: int, receiver: int, num_bytes: int) -> float:
    """Sends ``num_bytes`` over TCP from host ``sender`` to host ``receiver``; the receiver's seconds."""
    address = net.hosts[receiver].address
    rx = net.run(receiver, [sys.executable, "-c", RECEIVER, address, str(PORT)], stdout=subprocess.PIPE)
    tx = net.run(sender, [sys.executable, "-c", SENDER, address, str(PORT), str(num_bytes)])
    codes = wait_all([rx, tx], timeout_s=30)
    assert codes == [0, 0], f"transfer {sender} -> {receiver}: exit codes {codes}"
    received, seconds = rx.communicate(timeout=5)[0].split()
    assert int(received) == num_bytes
    return float(seconds)


@needs_hosts
@pytest.mark.timeout(300)
def test_torchrun_across_two_hosts(tmp_path):
    """One torchrun per host, the same command: the replicas agree and match one process, over the veth."""
    steps = 30
    spec = importlib.util.spec_from_file_location("train_example", REPO / "examples" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    vocab = train.corpus()[2]
    gradient_bytes = 4 * sum(p.numel() for p in train.CharModel(vocab).parameters())  # float32
    torchrun = Path(sys.executable).with_name("torchrun")

    with HostNet(num_hosts=2, rate="1gbit") as net:
        command = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
        command += ["--rdzv-endpoint", f"{net.hosts[0].address}:29500", "--rdzv-id", f"test-{os.getpid()}"]
        command += ["examples/train.py", "--steps", str(steps)]
        before = [net.counters(i) for i in range(2)]
        logs = [tmp_path / f"host{i}.log" for i in range(2)]
        start = time.monotonic()
        with contextlib.ExitStack() as files:
            processes = [
                # env(i): GLOO_SOCKET_IFNAME, --local-addr and is_host via PET_*; see hostnet's note on them.
                net.run(
                    i,
                    command,
                    env=net.env(i),
                    cwd=REPO,
                    stdout=files.enter_context(open(log, "wb")),
                    stderr=subprocess.STDOUT,
                )
                for i, log in enumerate(logs)
            ]
            codes = wait_all(processes, timeout_s=200)  # then leaving the net kills both process trees
        seconds = time.monotonic() - start
        after = [net.counters(i) for i in range(2)]
    outputs = [log.read_text(errors="replace") for log in logs]
    report = "\n".join(
        f"--- host {i} (exit {code}):\n{out[-3000:]}" for i, (code, out) in enumerate(zip(codes, outputs))
    )
    assert codes == [0, 0], report
    print(f"two hosts, {steps} steps: {seconds:.1f} s")
    combined = "\n".join(outputs)
    assert "identical: True" in combined and "match: True" in combined, report  # printed by global rank 0
    # A 2-rank all-reduce of S bytes sends and receives at least S per rank,
    # and the hosts share no interface but the veth: the gradients crossed it.
    for i in range(2):
        sent, received = after[i].tx_bytes - before[i].tx_bytes, after[i].rx_bytes - before[i].rx_bytes
        assert min(sent, received) >= steps * gradient_bytes, (i, sent, received, steps * gradient_bytes)


@needs_hosts
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_hosts", [2, 3])
@pytest.mark.parametrize("body_raises", [False, True])
def test_teardown_leaves_nothing(num_hosts, body_raises):
    links_before = root_links()
    net = HostNet(num_hosts=num_hosts, rate="1gbit")
    with contextlib.suppress(KeyError) if body_raises else contextlib.nullcontext():
        with net:
            assert set(net.namespaces) <= live_namespaces()
            sleepers = [net.run(i, ["sleep", "60"]) for i in range(num_hosts)]
            if body_raises:
                raise KeyError("the body failed")
    assert all(sleeper.poll() == -15 for sleeper in sleepers)  # terminated at close
    assert not {name for name in live_namespaces() if name.startswith(net.tag)}
    new_links = root_links() - links_before
    assert not {name for name in new_links if name in ("veth0", "br0") or name.startswith("port")}, new_links
    net.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        net.run(0, ["true"])


@needs_hosts
@pytest.mark.timeout(60)
@pytest.mark.parametrize("rate, num_bytes", [("1gbit", 50_000_000), ("100mbit", 5_000_000)])
def test_rate_is_limited(rate, num_bytes):
    limit = hostnet.parse_rate(rate)
    with HostNet(num_hosts=2, rate=rate) as net:
        seconds = transfer(net, sender=0, receiver=1, num_bytes=num_bytes)
    measured = num_bytes * 8 / seconds
    print(f"{num_bytes / 1e6:.0f} MB at {rate}: {seconds:.3f} s, {measured / 1e9:.3f} Gbit/s")
    # Above the rate only by the burst; the floor is loose for a busy machine.
    assert 0.2 * limit < measured < 1.3 * limit, f"{measured / 1e9:.3f} Gbit/s at rate={rate}"


@needs_hosts
@pytest.mark.timeout(60)
def test_three_hosts_reach_each_other_through_the_bridge():
    with HostNet(num_hosts=3, rate="1gbit") as net:
        for sender in range(3):
            transfer(net, sender=sender, receiver=(sender + 1) % 3, num_bytes=100_000)
        assert all(net.counters(i).tx_bytes >= 100_000 for i in range(3))


@needs_hosts
@pytest.mark.timeout(60)
def test_delay_without_netem_fails_saying_so():
    net = HostNet(num_hosts=2, delay="5ms")
    try:
        net.start()
    except RuntimeError as error:
        assert "netem" in str(error)  # this kernel has none: refused, not ignored
    else:
        with net:
            qdiscs = subprocess.run(
                ["tc", "-n", net.hosts[0].namespace, "qdisc", "show", "dev", "veth0"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            assert "netem" in qdiscs.stdout and "tbf" in qdiscs.stdout
    assert not {name for name in live_namespaces() if name.startswith(net.tag)}


@needs_hosts
@pytest.mark.timeout(60)
def test_stale_namespaces_of_dead_runs_are_removed():
    exited = subprocess.Popen(["true"])
    exited.wait()  # its pid is free now
    pid_namespace = os.stat("/proc/self/ns/pid").st_ino
    stale = f"trh{pid_namespace}-{exited.pid}-abcdef-h0"
    mine = f"trh{pid_namespace}-{os.getpid()}-abcdef-h0"  # a live process's: kept
    try:
        for name in (stale, mine):
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
        assert stale in netns.remove_stale()
        assert mine in live_namespaces() and stale not in live_namespaces()
    finally:
        for name in (stale, mine):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)


@needs_hosts
@pytest.mark.timeout(60)
def test_cli_runs_the_command_in_every_host():
    result = subprocess.run(
        [sys.executable, "-m", "hostnet", "--hosts", "2", "--rate", "100mbit", "--"]
        + ["sh", "-c", "echo $HOSTNET_ADDRESS $GLOO_SOCKET_IFNAME $PET_RDZV_CONF"],
        env=CLI_ENV,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0, result.stderr
    assert "[host0] 10.213.7.1 veth0 is_host=1" in result.stdout
    assert "[host1] 10.213.7.2 veth0 is_host=0" in result.stdout
    failing = subprocess.run(
        [sys.executable, "-m", "hostnet", "--", "sh", "-c", "exit $((3 + HOSTNET_INDEX))"],
        env=CLI_ENV,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert failing.returncode in (3, 4)


def test_spec_is_validated():
    assert hostnet.parse_rate("1gbit") == 1e9 and hostnet.parse_rate("100Mbit") == 1e8
    assert NetSpec(rate="1gbit").burst_bytes == 125_000  # 1 ms at the rate
    assert NetSpec(rate="10mbit").burst_bytes == hostnet.MIN_BURST_BYTES
    with pytest.raises(ValueError, match="num_hosts=1"):
        HostNet(num_hosts=1)
    with pytest.raises(ValueError, match="rate='1GB'"):
        HostNet(rate="1GB")
    with pytest.raises(ValueError, match="delay='5'"):
        HostNet(delay="5")
