"""Network namespaces from Python: the ``ip``/``tc`` commands, names, and the processes inside.

The system side of hostnet (its ``__init__.py``), which holds the network itself (what hosts,
links and limits to build). Here: running ``ip`` and ``tc`` with a timeout
(``check``, and ``cleanup`` for teardown, which reports instead of raising),
whether namespaces work here at all (``probe``), deleting them with
everything inside (``delete_namespaces``), and the names this tool gives
its namespaces, ``trh<pid namespace>-<pid>-<token>-<suffix>``: the creating
process's pid in them lets a later run find the namespaces of a run killed
outright and delete them (``remove_stale``), together with any process still
inside (``kill_processes_in``).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

KILL_GRACE_S = 3.0  # SIGTERM first, then SIGKILL after this (the command line waits as long)

_NAME_PREFIX = "trh"  # torchreplicate hosts: trh<pid namespace>-<pid>-<token>-<h0|h1|...|hub|probe>
_STALE_NAME = re.compile(rf"^{_NAME_PREFIX}(?P<pidns>\d+)-(?P<pid>\d+)-[0-9a-f]+-(?:h\d+|hub|probe)$")
_COMMAND_TIMEOUT_S = 10.0  # any one `ip` or `tc` call


class CommandError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; carries its stderr."""

    def __init__(self, argv: Sequence[str], detail: str) -> None:
        super().__init__(f"`{' '.join(argv)}` failed: {detail}")
        self.detail = detail  # the command's stderr, or why it did not finish


def new_tag() -> str:
    """A fresh prefix for a set of namespace names, ``trh<pid namespace>-<pid>-<token>``.

    The pid keeps concurrent processes apart and the token concurrent sets in
    one process; ``remove_stale`` reads the pid back once this process is gone.
    """
    return f"{_NAME_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(3)}"


def probe(qdisc: Sequence[str]) -> tuple[bool, str]:
    """Whether namespaces, a veth pair and ``qdisc`` on it can be made here, and why not.

    Args:
        qdisc: a root qdisc and its parameters as ``tc qdisc add`` takes them,
            e.g. ``["tbf", "rate", "1gbit", ...]``.

    Returns:
        ``(True, what works)``, or ``(False, why not)``: not Linux, not root,
        no ``ip``/``tc``, or the kernel refused a namespace, the veth or the
        qdisc.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces are Linux only; this is {sys.platform}"
    if os.geteuid() != 0:
        return False, f"creating network namespaces needs root; this process runs as uid {os.geteuid()}"
    for name in ("ip", "tc"):
        if _find_tool(name) is None:
            return False, f"`{name}` not found; install iproute2 (scripts/setup.sh does, as root with apt-get)"
    namespace = f"{new_tag()}-probe"
    try:
        check(["ip", "netns", "add", namespace])
    except CommandError as error:
        return False, f"cannot create a network namespace: {error}"
    try:
        check(["ip", "-n", namespace, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"])
        check(["tc", "-n", namespace, "qdisc", "add", "dev", "a", "root", *qdisc])
    except CommandError as error:
        return False, f"namespaces work but veth or {qdisc[0]} do not: {error}"
    finally:
        cleanup(["ip", "netns", "delete", namespace])
    return True, f"network namespaces, veth and {qdisc[0]} work here"


def remove_stale() -> list[str]:
    """Deletes this tool's namespaces whose creating process is dead (a run killed outright); returns them.

    Only names made in this pid namespace are judged, since a pid means
    nothing in another one.
    """
    listing = check(["ip", "netns", "list"])
    removed = []
    for line in listing.splitlines():
        name = line.split(" ", 1)[0]
        match = _STALE_NAME.match(name)
        if match is None or int(match["pidns"]) != _pid_namespace() or _is_alive(int(match["pid"])):
            continue
        kill_processes_in(name)
        cleanup(["ip", "netns", "delete", name])
        removed.append(name)
    return removed


def kill_processes_in(namespace: str) -> None:
    """SIGTERM to every process in ``namespace``, SIGKILL to any left after ``KILL_GRACE_S``."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_in(namespace)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = _pids_in(namespace)
        if not pids:
            return


def delete_namespaces(namespaces: Sequence[str], processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kills ``processes`` and every process inside ``namespaces``, reaps them, deletes the namespaces.

    Args:
        namespaces: the namespaces, in the order they were made (deleted
            last first).
        processes: the processes started into them (``ip netns exec``),
            running or not.
    """
    for process in processes:
        if process.poll() is None:
            process.terminate()  # also reaches one that has not entered its namespace yet
    for namespace in reversed(namespaces):
        kill_processes_in(namespace)
    for process in processes:  # reap them: killed above, or exited before
        try:
            process.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=KILL_GRACE_S)
    for namespace in reversed(namespaces):
        cleanup(["ip", "netns", "delete", namespace])


def tool(name: str) -> str:
    """The path of ``ip`` or ``tc`` (``name``).

    Raises:
        RuntimeError: it is not installed.
    """
    path = _find_tool(name)
    if path is None:
        raise RuntimeError(f"HostNet: `{name}` not found; install iproute2")
    return path


def check(argv: list[str]) -> str:
    """Runs an ``ip``/``tc`` command within ``_COMMAND_TIMEOUT_S``; returns its stdout.

    Raises:
        CommandError: it failed or did not finish in time.
        RuntimeError: the tool is not installed.
    """
    try:
        result = subprocess.run(
            [tool(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise CommandError(argv, f"no answer within {_COMMAND_TIMEOUT_S:.0f} s") from None
    if result.returncode != 0:
        raise CommandError(argv, result.stderr.strip() or f"exit status {result.returncode}")
    return result.stdout


def cleanup(argv: list[str]) -> None:
    """As ``check``, for clean-up: a failure is reported, not raised, so the rest still runs."""
    try:
        check(argv)
    except (CommandError, RuntimeError) as error:
        print(f"hostnet: clean-up step failed: {error}", file=sys.stderr)


def _pids_in(namespace: str) -> list[int]:
    try:
        output = check(["ip", "netns", "pids", namespace])
    except CommandError:
        return []  # the namespace is gone
    return [int(pid) for pid in output.split() if int(pid) != os.getpid()]


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _find_tool(name: str) -> str | None:
    # /usr/sbin is often missing from PATH outside a root login shell.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
