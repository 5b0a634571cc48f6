"""The command line of hostnet: ``python -m hostnet --hosts 2 --rate 1gbit -- COMMAND`` (``tools/`` on PYTHONPATH).

Runs one command in every host (each line prefixed with its host), or a
shell in host 0, and tears the hosts down at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

from hostnet import HostNet, wait_all
from hostnet.netns import KILL_GRACE_S


def _forward_lines(prefix: str, source: IO[bytes]) -> None:
    for line in iter(source.readline, b""):
        sys.stdout.buffer.write(prefix.encode() + line)
        sys.stdout.buffer.flush()


def _exit_status(code: int) -> int:
    return code if code >= 0 else 128 - code  # -N: killed by signal N, as a shell reports it


def _run_shell(net: HostNet, timeout_s: float) -> int:
    print("host 0's shell; leave it to delete the hosts", file=sys.stderr)
    shell = net.run(0, [os.environ.get("SHELL", "/bin/sh")], env=net.env(0))
    try:
        return _exit_status(shell.wait(timeout=timeout_s))
    except subprocess.TimeoutExpired:
        return 124


def _run_everywhere(net: HostNet, command: Sequence[str], timeout_s: float) -> int:
    """Runs ``command`` in every host, output prefixed ``[hostI]``; the first failure's status, 0, or 124."""
    processes = [
        net.run(host.index, command, env=net.env(host.index), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for host in net.hosts
    ]
    forwarders = [
        threading.Thread(target=_forward_lines, args=(f"[host{i}] ", process.stdout), daemon=True)
        for i, process in enumerate(processes)
    ]
    for forwarder in forwarders:
        forwarder.start()
    # Until all exit, one fails (the others would wait for it), or the time is up.
    codes = wait_all(processes, timeout_s)
    failures = [code for code in codes if code]
    status = _exit_status(failures[0]) if failures else 0
    if not failures and any(code is None for code in codes):
        status = 124
        print(f"hostnet: timed out after {timeout_s:.0f} s; killing every host's processes", file=sys.stderr)
    net.close()  # kills what is left, which ends the output
    for forwarder in forwarders:
        forwarder.join(timeout=KILL_GRACE_S)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: ``python -m hostnet [--hosts N] [--rate R] (shell | -- COMMAND ...)``."""
    parser = _parser()
    options = parser.parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser.error("give 'shell' or '-- COMMAND ARGS'")
    try:
        net = HostNet(
            num_hosts=options.hosts, rate=None if options.rate == "none" else options.rate, delay=options.delay
        )
    except ValueError as error:
        parser.error(str(error))
    try:
        net.start()
    except RuntimeError as error:
        print(f"hostnet: {error}", file=sys.stderr)
        return 1
    try:
        _print_hosts(net)
        return (
            _run_shell(net, options.timeout) if command == ["shell"] else _run_everywhere(net, command, options.timeout)
        )
    finally:
        net.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hostnet",
        description="Run COMMAND in each of N hosts (network namespaces joined by rate-limited links), "
        "then delete them. Each host gets the variables of HostNet.env(i), so one torchrun line fits all: "
        "torchrun --nnodes N ... --rdzv-backend c10d --rdzv-endpoint 10.213.7.1:29500 --rdzv-id JOB train.py",
    )
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    parser.add_argument("--rate", default="1gbit", help="link rate in tc's notation, or 'none' (default 1gbit)")
    parser.add_argument("--delay", default=None, help="one-way delay, e.g. 5ms (needs netem; default none)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="kill everything after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="'shell', or '-- COMMAND ARGS' for every host")
    return parser


def _print_hosts(net: HostNet) -> None:
    # How to enter each host by hand, with the environment a program gets there.
    for host in net.hosts:
        variables = " ".join(f"{key}={value}" for key, value in net.env(host.index).items())
        print(
            f"host {host.index}: {host.address} on {host.interface}; a shell there: "
            f"ip netns exec {host.namespace} env {variables} bash",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(main())
