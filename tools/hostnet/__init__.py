"""Several hosts on one machine: network namespaces joined by rate-limited links.

Multi-node code (``torchrun --nnodes 2``) needs several hosts to be tested;
this package makes them on one Linux machine, as root, so that CI can run a
real multi-node launch and a benchmark can run at a chosen link rate::

    with HostNet(num_hosts=2, rate="1gbit") as net:
        procs = [net.run(i, ["torchrun", ...], env=net.env(i)) for i in range(2)]

    PYTHONPATH=tools python -m hostnet --hosts 2 --rate 1gbit -- torchrun ... train.py
    PYTHONPATH=tools python -m hostnet --hosts 2 shell

Each host is a network namespace with loopback up and one interface,
``veth0``, holding ``10.213.7.<i+1>/24``. Two hosts are one veth pair; more
hosts each have a veth to a bridge in a hub namespace. Nothing is created in
the machine's own namespace and no host has a route beyond the /24, so no
packet can leave the hosts; two runs at once, each in namespaces of its own,
can use the same addresses and ports. The ``ip``/``tc`` commands, the
namespaces' names and their teardown are in netns.py, the command line in
__main__.py. A tool of the repository's tests and benchmarks (``tools/`` on
``sys.path``), not part of the installed torchreplicate.

[Note: rate limit]
Every host's interface has an egress ``tbf`` (token bucket) at ``rate``; with a
bridge, the hub's port towards each host has one too, so a host receives at no
more than ``rate`` either (a switch port). ``burst`` is the bytes let through
back to back after an idle spell: 1 ms at the rate (125 kB at 1gbit, 1.25 MB at
10gbit), at least 32 KiB. Much smaller and the bucket empties between two
timer wake-ups, so the link runs below its rate; much larger and a short
message (a small bucket of gradients) crosses faster than the rate would
allow. ``latency`` (20 ms) caps the queue at burst + 20 ms of traffic; TCP's
small-queue back-pressure keeps a sender far below that, so packets are paced,
not dropped. Measured on a 2-core machine: 0.93-0.95 Gbit/s at 1gbit, 1.8 at
2gbit; at 10gbit the CPUs copying the bytes are the limit (5-6 Gbit/s there).

[Note: what torchrun and gloo need in a host]
Inside a namespace the machine's hostname still resolves to a loopback address
(as it does on a machine with Debian's ``127.0.1.1 hostname`` line), so what
torchrun and gloo learn from the hostname is wrong, and ``env(i)`` sets it:

- ``GLOO_SOCKET_IFNAME=veth0``: else gloo binds to the hostname's address, a
  loopback one, and tells the other ranks to connect there; init fails after
  a few seconds ("Connection refused, remote=[127.0.0.1]:...").
- ``PET_LOCAL_ADDR`` (torchrun's ``--local-addr``): the node that gets rank 0
  publishes this as the workers' ``MASTER_ADDR``; by default its FQDN, which on
  another host resolves to that host's own loopback, and those workers wait
  for a store that is not there until the store's timeout.
- ``PET_RDZV_CONF=is_host=1`` on host 0, ``is_host=0`` elsewhere: the c10d
  rendezvous guesses whether to serve its store by comparing the endpoint with
  its hostname's addresses; here no host matches, nobody serves it, and every
  host retries connecting for minutes. So the rendezvous endpoint is host 0
  (``10.213.7.1:PORT``).

With these in the environment, the same ``torchrun --nnodes N ...
--rdzv-endpoint 10.213.7.1:29500`` command runs in every host (an explicit
``--rdzv-conf`` or ``--local-addr`` on the command line replaces them).
c10d's warning "The hostname of the client socket cannot be retrieved" is
harmless: the hosts' addresses have no names.

Limits: Linux, root, iproute2 (``ip``, ``tc``), and the kernel's veth, bridge
and tbf. ``delay`` needs the netem qdisc (``sch_netem``), absent from some
kernels: there it raises instead of running without the delay. The hosts
share the machine's CPUs, memory, files and hostname; only the network is
theirs. Processes left in a host are killed when the net closes.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType, TracebackType
from typing import IO, Any, NamedTuple, Union

from hostnet import netns

SUBNET_PREFIX = "10.213.7"  # host i has SUBNET_PREFIX.<i+1>/24; private, and only ever inside our namespaces
INTERFACE = "veth0"  # every host's one interface, so one command line fits every host
MAX_HOSTS = 64
TBF_LATENCY = "20ms"  # see [Note: rate limit]
MIN_BURST_BYTES = 32 * 1024

_RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)", re.IGNORECASE)
_RATE_UNIT = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}  # SI, as tc reads them
_DELAY = re.compile(r"\d+(?:\.\d+)?(?:us|ms|s)")

Output = Union[int, IO[Any], None]  # what subprocess.Popen takes for stdin/stdout/stderr


def parse_rate(rate: str) -> float:
    """Bits per second of a rate in tc's notation: ``"1gbit"`` -> 1e9 (SI units, as tc)."""
    match = _RATE.fullmatch(rate.strip())
    if match is None:
        raise ValueError(f"HostNet: rate={rate!r} is not a rate in tc's notation; write e.g. '100mbit', '1gbit'")
    return float(match.group(1)) * _RATE_UNIT[match.group(2).lower()]


@dataclasses.dataclass(frozen=True)
class NetSpec:
    """What network to build; validated on construction."""

    num_hosts: int = 2
    """Hosts to create, 2 to ``MAX_HOSTS``."""
    rate: str | None = "1gbit"
    """Egress limit of every host's link in tc's notation (``"1gbit"``, ``"10gbit"``); ``None``: no limit."""
    delay: str | None = None
    """One-way delay added to every host's egress (``"5ms"``); needs netem, raises where it is absent."""

    def __post_init__(self) -> None:
        if not 2 <= self.num_hosts <= MAX_HOSTS:
            raise ValueError(f"HostNet: num_hosts={self.num_hosts}; give 2 to {MAX_HOSTS} hosts")
        if self.rate is not None:
            parse_rate(self.rate)
        if self.delay is not None and _DELAY.fullmatch(self.delay) is None:
            raise ValueError(f"HostNet: delay={self.delay!r} is not a time; write e.g. '500us', '5ms'")

    @property
    def burst_bytes(self) -> int:
        """tbf's bucket: 1 ms at the rate, at least ``MIN_BURST_BYTES`` (see [Note: rate limit])."""
        assert self.rate is not None
        return max(MIN_BURST_BYTES, int(parse_rate(self.rate) / 8 / 1000))


@dataclasses.dataclass(frozen=True)
class Host:
    """One host: a network namespace and its one interface."""

    index: int
    namespace: str  # for `ip netns exec NAMESPACE ...`
    address: str  # IPv4 address of `interface`
    interface: str = INTERFACE


class LinkCounters(NamedTuple):
    """Bytes through a host's interface since the net was built."""

    rx_bytes: int
    tx_bytes: int


class NetState(enum.Enum):
    """Where a ``HostNet`` is in its life: new, up, closed."""

    NEW = "new"  # names chosen, nothing created
    UP = "up"  # namespaces exist (or are being built); close() tears them down
    CLOSED = "closed"  # torn down; cannot be started again


class HostNet:
    """``num_hosts`` hosts joined by links of ``rate``; a context manager.

    Args:
        num_hosts: hosts to create, 2 to ``MAX_HOSTS`` (default 2).
        rate: egress limit of every host's link in tc's notation (default
            ``"1gbit"``); ``None``: unlimited (as fast as the CPUs copy).
        delay: one-way delay on every host's egress, e.g. ``"5ms"`` (default
            ``None``). Needs the netem qdisc; where the kernel lacks it,
            starting the net raises ``RuntimeError`` saying so.

    ``start()`` (or entering the ``with``) builds the hosts, ``close()`` (or
    leaving it, also on an exception) kills every process inside them and
    deletes them; an ``atexit`` hook and a SIGTERM/SIGHUP handler (installed
    where the signal had its default action) close it too. Namespaces left by a
    run killed outright are deleted by the next start (see ``netns.remove_stale``).
    """

    def __init__(self, *, num_hosts: int = 2, rate: str | None = "1gbit", delay: str | None = None) -> None:
        self.spec = NetSpec(num_hosts=num_hosts, rate=rate, delay=delay)
        self.tag = netns.new_tag()  # namespace names: <tag>-h0, <tag>-h1, ..., <tag>-hub
        self.hosts = tuple(
            Host(index=i, namespace=f"{self.tag}-h{i}", address=f"{SUBNET_PREFIX}.{i + 1}") for i in range(num_hosts)
        )
        # - Lifecycle: what exists now, so close() removes exactly that.
        self.state = NetState.NEW
        self._created: list[str] = []  # namespaces made so far, in order
        self._processes: list[subprocess.Popen[bytes]] = []  # started by run(), reaped at close
        self._previous_handlers: dict[int, Any] = {}  # signal -> its handler before start()

    @property
    def hub_namespace(self) -> str | None:
        """The namespace holding the bridge (3 or more hosts), else ``None``."""
        return f"{self.tag}-hub" if self.spec.num_hosts > 2 else None

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace this net creates: the hosts', then the hub's."""
        hub = (self.hub_namespace,) if self.hub_namespace else ()
        return tuple(host.namespace for host in self.hosts) + hub

    def __enter__(self) -> HostNet:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> HostNet:
        """Builds the hosts; on any failure removes what was built and raises."""
        if self.state is not NetState.NEW:
            raise RuntimeError(f"HostNet.start(): the net is {self.state.value}; make a new HostNet")
        ok, reason = available()
        if not ok:
            raise RuntimeError(f"HostNet: cannot create hosts here: {reason}")
        netns.remove_stale()
        self.state = NetState.UP
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kills every process inside the hosts, deletes them. Idempotent."""
        if self.state is not NetState.UP:
            self.state = NetState.CLOSED
            return
        try:
            netns.delete_namespaces(self._created, self._processes)
            self._created.clear()
        finally:
            self.state = NetState.CLOSED
            atexit.unregister(self.close)
            self._restore_signal_handlers()

    def run(
        self,
        host: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: Output = None,
        stdout: Output = None,
        stderr: Output = None,
    ) -> subprocess.Popen[bytes]:
        """Starts ``argv`` inside host ``host`` (``ip netns exec``); killed at ``close()`` if still running.

        Args:
            host: the host's index.
            argv: the command and its arguments.
            env: variables added to this process's environment (default
                ``None``: none); ``self.env(host)`` holds what torchrun and
                gloo need here.
            cwd: working directory (default ``None``: this process's).
            stdin, stdout, stderr: as for ``subprocess.Popen`` (default
                ``None``: inherited).
        """
        if self.state is not NetState.UP:
            raise RuntimeError(f"HostNet.run(): the net is {self.state.value}; run commands inside `with HostNet()`")
        if not 0 <= host < len(self.hosts):
            raise ValueError(f"HostNet.run(): host={host}; this net has hosts 0 to {len(self.hosts) - 1}")
        if not argv:
            raise ValueError("HostNet.run(): argv is empty; give the command to run")
        process = subprocess.Popen(
            [netns.tool("ip"), "netns", "exec", self.hosts[host].namespace, *argv],
            env={**os.environ, **(env or {})},
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
        )
        self._processes.append(process)
        return process

    def env(self, host: int) -> dict[str, str]:
        """What a multi-node program needs on host ``host``: see [Note: what torchrun and gloo need in a host].

        ``HOSTNET_INDEX`` and ``HOSTNET_ADDRESS`` say which host it is.
        """
        address = self.hosts[host].address
        return {
            "HOSTNET_INDEX": str(host),
            "HOSTNET_ADDRESS": address,
            "GLOO_SOCKET_IFNAME": INTERFACE,
            "PET_LOCAL_ADDR": address,
            "PET_RDZV_CONF": f"is_host={int(host == 0)}",
        }

    def counters(self, host: int) -> LinkCounters:
        """Bytes received and sent by host ``host``'s interface so far."""
        output = netns.check(["ip", "-n", self.hosts[host].namespace, "-j", "-s", "link", "show", "dev", INTERFACE])
        stats = json.loads(output)[0]["stats64"]
        return LinkCounters(rx_bytes=int(stats["rx"]["bytes"]), tx_bytes=int(stats["tx"]["bytes"]))

    def _build(self) -> None:
        for namespace in self.namespaces:
            netns.check(["ip", "netns", "add", namespace])
            self._created.append(namespace)
        # Each end is made inside its namespace, never in the machine's own.
        hub = self.hub_namespace
        if hub is None:
            first, second = self.hosts
            veth = ["type", "veth", "peer", "name", INTERFACE, "netns", second.namespace]
            netns.check(["ip", "link", "add", "name", INTERFACE, "netns", first.namespace, *veth])
        else:
            # STP off: ports forward at once.
            netns.check(["ip", "-n", hub, "link", "add", "name", "br0", "type", "bridge"])
            netns.check(["ip", "-n", hub, "link", "set", "br0", "up"])
            for host in self.hosts:
                port = f"port{host.index}"
                veth = ["type", "veth", "peer", "name", port, "netns", hub]
                netns.check(["ip", "link", "add", "name", INTERFACE, "netns", host.namespace, *veth])
                netns.check(["ip", "-n", hub, "link", "set", port, "master", "br0", "up"])
                self._shape(hub, port)  # the host's download: a switch port's egress
        for host in self.hosts:
            netns.check(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE])
            netns.check(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
            netns.check(["ip", "-n", host.namespace, "link", "set", INTERFACE, "up"])
            self._shape(host.namespace, INTERFACE)

    def _shape(self, namespace: str, device: str) -> None:
        """Delay (netem) then rate (tbf) on ``device``'s egress; see [Note: rate limit]."""
        parent = ["root"]
        if self.spec.delay is not None:
            try:
                netem = ["netem", "delay", self.spec.delay]
                netns.check(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", *netem])
            except netns.CommandError as error:
                raise RuntimeError(
                    f"HostNet(delay={self.spec.delay!r}): this kernel has no netem qdisc ({error.detail}), so "
                    "the delay cannot be applied; load sch_netem (`modprobe sch_netem`) or use delay=None"
                ) from None
            parent = ["parent", "1:1"]
        if self.spec.rate is not None:
            tbf = ["tbf", "rate", self.spec.rate, "burst", str(self.spec.burst_bytes), "latency", TBF_LATENCY]
            netns.check(["tc", "-n", namespace, "qdisc", "add", "dev", device, *parent, "handle", "10:", *tbf])

    def _install_signal_handlers(self) -> None:
        # Only where the signal would kill us without cleanup, and only from
        # the main thread (Python's rule); SIGINT already raises.
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is signal.SIG_DFL:
                self._previous_handlers[signum] = signal.signal(signum, _exit_on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():  # else left: they only raise SystemExit
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
        self._previous_handlers.clear()


def wait_all(processes: Sequence[subprocess.Popen[Any]], timeout_s: float) -> list[int | None]:
    """Exit codes once all exited or one failed (the others would wait for it), else at the deadline.

    ``None`` for a process still running. The hosts' processes of one job
    (one rank per host) end together or not at all: a failure anywhere ends
    the wait at once.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes) or any(codes):
            return codes
        time.sleep(0.1)
    return [process.poll() for process in processes]


def available() -> tuple[bool, str]:
    """Whether hosts can be made here, and why not: tries a namespace, a veth and a tbf."""
    return netns.probe(["tbf", "rate", "1gbit", "burst", str(MIN_BURST_BYTES), "latency", TBF_LATENCY])


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through `with HostNet()`, which tears down
