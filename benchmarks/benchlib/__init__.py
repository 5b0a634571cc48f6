"""Shared pieces of the benchmarks, one module per job.

- ``models``: the benchmark models and their batches, built alike on every rank;
- ``engines``: ``Engine``, one model copy wrapped one way with its own optimizer;
- ``ranks``: starting rank processes (``launch_phase``) and what each does first;
- ``hosts``: ranks on hosts of their own (``launch_on_hosts``: one process per
  ``hostnet`` host, joined by a rate-limited link; hostnet is the repository's
  tools/hostnet, which this package puts on ``sys.path``);
- ``rounds``: ``run_rounds``, the interleaved timed rounds;
- ``stats``: summaries, paired per-round ratios, ``aggregate_timing``;
- ``timeline``: when the phases of a step happen (``trace_steps``, our
  reducer's per-bucket timeline) and the line-rate schedule of its buckets;
- ``collectives``: counting collectives and bytes on the wire;
- ``memory``: the peak-RSS phase;
- ``breakdown``: our reducer's phases, read from ``torch.profiler`` labels;
- ``breakdown_table``: the breakdown's table and warnings in the report;
- ``report``: run environment, JSON and markdown files.

The scripts import these as ``benchlib.<module>``: a script's own folder is
on ``sys.path`` when it runs as ``python benchmarks/<script>.py``.
"""

import importlib.util
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A checkout without ``pip install -e .``: fall back to its src/. Spawned
# ranks inherit sys.path, so they import the same copy.
if importlib.util.find_spec("torchreplicate") is None:
    sys.path.insert(0, os.path.join(_REPO, "src"))
# hostnet (benchlib.hosts, bench_net.py) is not installed: it lives in the
# checkout's tools/. Ranks started on hosts import benchlib too, so find it.
if importlib.util.find_spec("hostnet") is None:
    sys.path.insert(0, os.path.join(_REPO, "tools"))
# The tests' launcher (tests/local_ranks.py: ranks with a deadline that kills
# them all), which ``ranks`` and ``hosts`` use; the tests' modules import as top-level names.
if importlib.util.find_spec("local_ranks") is None:
    sys.path.insert(0, os.path.join(_REPO, "tests"))
