"""Host reads of tensor values in a steady-state step, counted on the CPU (issue 39).

On a GPU, each ``.item()``, ``.tolist()``, ``bool(tensor)``, ``.cpu()`` ...
is a synchronisation: the CPU stops queueing work (the optimizer step, the
next forward) until the GPU has caught up. DDP at its defaults makes none in
a step. Here every such call made from the library's own code during steady
steps is counted, by wrapping the methods for the duration, in the patterns
a GPU job runs: a plain MLP, BatchNorm (buffers broadcast), gradient
accumulation under ``no_sync``, mixed precision, a comm hook, copied
gradients (``gradient_as_bucket_view=False``) and a tied embedding (reduced
whole in its bucket at default options, as DDP's): none.
``nonzero``, an event's ``synchronize`` and ``torch.tensor(..., device=)``
(a copy from pageable host memory, which on a GPU waits for the host) are
counted too (the sync-debug mode sees none of the latter two).

The summed flags are read a step late, from a host copy made without waiting
([Note: flags read a step late] in reducer/flags.py). What still reads, and
when: a rank that holds no gradient for some parameter reads those
parameters' counts in that step (as DDP with ``find_unused_parameters=True``),
``graph="dynamic"`` reads the flags at the end of every step, and the tied
split (``tied_split=True``, an opt-in) reads the summed rows mask once per
step, after the buckets: the rows round's size depends on the batch.
"""

from __future__ import annotations

import pytest

from host_reads import SHAPES, by_file, expected_reads, reads_by_step


@pytest.mark.parametrize("pattern", SHAPES)
def test_no_host_read_in_a_steady_step(pools, pattern):
    for rank, per_step in enumerate(pools.run(2, reads_by_step, pattern)):
        assert per_step == [{}, {}, {}], (
            f"{pattern}, rank {rank}: host reads from library code in steady steps 3-5: {per_step}; "
            "none may appear ([Note: flags read a step late] in reducer/flags.py)"
        )


def test_reads_come_only_where_a_parameter_is_unused_here_or_with_graph_dynamic(pools):
    # step 4: rank 1 leaves the head unused, so it reads the head's counts (does
    # any rank hold a gradient for it?) before setting .grad; rank 0 used it: no read
    for pattern in ("unused", "tied_unused"):
        unused = pools.run(2, reads_by_step, pattern)
        assert unused[0] == [{}, {}, {}], (pattern, unused[0])
        assert unused[1] == [{}, {"reducer/flags.py:unused_everywhere (tolist)": 1}, {}], (pattern, unused[1])
        for rank in (0, 1):  # what the GPU check's sync audit expects (host_reads.expected_reads)
            assert [by_file(c) for c in unused[rank]] == [expected_reads(pattern, i, rank == 1) for i in (3, 4, 5)]
    # the tied split (an opt-in): the rows round's size is data-dependent, so one read per step, on
    # every rank, after the buckets (the summed rows mask's nonzero)
    for per_step in pools.run(2, reads_by_step, "tied", tied_split=True):
        where = [(at.split(":")[0], at.split(" ")[-1], n) for counts in per_step for at, n in counts.items()]
        assert where == [("reducer/tied_rows.py", "(nonzero)", 1)] * 3, per_step  # one tied parameter here
        assert [by_file(c) for c in per_step] == [expected_reads("tied", i, False, tied_split=True) for i in (3, 4, 5)]
    # graph="dynamic": the flags are read at the end of every step, on every rank
    for per_step in pools.run(2, reads_by_step, "batchnorm", graph="dynamic"):
        assert per_step == [{"reducer/flags.py:read (tolist)": 1}] * 3, per_step
        assert [by_file(c) for c in per_step] == [
            expected_reads("batchnorm", i, False, graph="dynamic") for i in (3, 4, 5)
        ]
