"""Comm hooks: DDP's stock hooks run unchanged.

The rank-side code is in comm_hook_cases.py. Two ranks. The protocol a hook
sees (bucket order, views, errors, custom hooks) is in
test_comm_hook_protocol.py.

What gloo on CPU does not support (torch 2.13.0, and DDP behaves the same):

* quantization_pertensor_hook / quantization_perchannel_hook index the
  all_gather future's value as NCCL returns it; gloo returns a flat list,
  so the hook's own callback raises IndexError. We assert that failure.
* batched_powerSGD_hook calls ``_orthogonalize`` on a 2-D Q, which fails
  that function's 3-D assertion at the first compressed step. We assert
  that failure too (and convergence, should a later torch fix it).
* PowerSGD with more than one bucket: its callbacks launch collectives
  from gloo's worker threads, so buckets in flight together interleave
  differently on each rank. DDP hangs or aborts there; replicate() calls a
  bucket's hook only once the previous bucket's future is done ([Note:
  hooks run one bucket at a time] in reducer.py), and test_hook_checkpoint.py
  trains PowerSGD over several buckets. The tests here use one bucket.
"""

import pytest

import comm_hook_cases as cases


def _raise_errors(results):
    errors = [
        f"--- rank {rank} (step {r.get('step')}) ---\n{r['error']}" for rank, r in enumerate(results) if "error" in r
    ]
    if errors:
        raise AssertionError("\n".join(errors))


# -- stock hooks: same replicas everywhere, gradients as promised -----------------------

STOCK = [
    # hook name, comparison (see comm_hook_cases._check_grads), replicate options
    pytest.param("allreduce_none", "exact", {}, id="allreduce-state-None"),
    pytest.param("allreduce_group", "exact", {}, id="allreduce-state-group"),
    pytest.param("allreduce_none", "exact", cases.TINY, id="allreduce-tiny-buckets"),
    pytest.param("fp16", "fp16", cases.TINY, id="fp16_compress_hook"),
    pytest.param("bf16", "bf16", cases.TINY, id="bf16_compress_hook"),
    pytest.param("fp16_wrapper", "fp16", cases.TINY, id="fp16_compress_wrapper"),
    pytest.param("bf16_wrapper", "bf16", cases.TINY, id="bf16_compress_wrapper"),
    pytest.param("noop", "local", cases.TINY, id="noop_hook"),
]


@pytest.mark.parametrize("hook_name, compare, options", STOCK)
def test_stock_hook(pools, hook_name, compare, options):
    """Four SGD steps; each step's grads checked against the single-process reference.

    Tolerances (comm_hook_cases._check_grads): all-reduce rtol 1e-5 /
    atol 1e-6 of the global-batch gradient and bitwise the mean of the
    ranks' local gradients; fp16 / bf16 |g - ref| <= 3u * mean_r |g_r| + 1e-6 with unit
    roundoff u = 2^-11 / 2^-8 (two roundings of at most u each); noop:
    bitwise the local gradient. bf16 runs on CPU too, though DDP refuses it
    there ("requires CUDA 11+ and NCCL 2.10+").
    """
    results = pools.run(2, cases.train_with_hook, hook_name, compare=compare, replicate_kwargs=options, timeout_s=60)
    _raise_errors(results)
    if options:
        assert results[0]["num_buckets"] >= 3, "tiny caps should give several buckets"
    if compare == "local":
        assert results[0]["digests"] != results[1]["digests"], (
            "with noop_hook nothing is averaged, so the replicas must diverge"
        )
        return
    assert results[0]["digests"] == results[1]["digests"], "replicas are not bitwise identical"
    if compare in ("fp16", "bf16"):
        assert all(r["differs"] for r in results), f"{hook_name} left the fp32 gradients untouched: no compression"
        assert all(r["worst_ratio"] <= 1.0 for r in results)


# -- PowerSGD ------------------------------------------------------------------------


def test_powerSGD_hook_converges(pools):
    """rank-1 PowerSGD (error feedback, warm start from step 2): the loss falls 100x in 100 steps.

    Plain SGD falls ~800x there, PowerSGD ~770x. One bucket: see the module docstring.
    """
    results = pools.run(2, cases.powersgd_regression, "powerSGD", timeout_s=60)
    _raise_errors(results)
    assert results[0]["digests"] == results[1]["digests"], "replicas are not bitwise identical"
    for r in results:
        assert r["last_loss"] < r["first_loss"] / 100, (r["first_loss"], r["last_loss"])
        assert r["state_iter"] == 100, "PowerSGD counts a step at each is_last() bucket"
        assert r["compressed_buckets"] == [0], "PowerSGD never compressed"


def test_batched_powerSGD_hook(pools):
    """The vanilla steps run; at the first compressed step torch 2.13's hook itself fails.

    batched_powerSGD_hook passes the 2-D Q to _orthogonalize, which asserts
    3-D input: an AssertionError on every rank at step start_powerSGD_iter
    (2), the same under DDP, leaving the group usable. Should torch fix
    the hook, the test requires convergence instead.
    """
    results = pools.run(2, cases.powersgd_regression, "batched_powerSGD", timeout_s=60)
    if any("error" in r for r in results):
        for r in results:
            assert "error" in r, "only some ranks failed"
            assert r["step"] == 2, r["error"]
            assert "AssertionError" in r["error"] and "_orthogonalize" in r["error"], r["error"]
            assert r["digests"] == results[0]["digests"], "replicas diverged in the vanilla steps"
        ddp = pools.run(2, cases.first_backward_error, "batched_powerSGD", ddp=True, timeout_s=60)
        assert all(r["error"] and "_orthogonalize" in r["error"] and r["step"] == 2 for r in ddp), ddp
        assert all(r["group_ok"] for r in ddp)
        return
    assert results[0]["digests"] == results[1]["digests"]
    for r in results:
        assert r["last_loss"] < r["first_loss"] / 10


# -- quantization hooks: not on gloo -----------------------------------------------------


@pytest.mark.parametrize("hook_name", ["quant_pertensor", "quant_perchannel"])
def test_quantization_hook_fails_clearly_on_gloo(pools, hook_name):
    """Every rank raises the hook's own IndexError at the first backward, as DDP does."""
    ours = pools.run(2, cases.first_backward_error, hook_name, ddp=False, timeout_s=60)
    ddp = pools.run(2, cases.first_backward_error, hook_name, ddp=True, timeout_s=60)
    for label, results in (("replicate", ours), ("DDP", ddp)):
        for r in results:
            assert r["error"] is not None, f"{label}: {hook_name} now works on gloo: test it properly"
            assert r["step"] == 0, f"{label}: {r['error']}"
            assert "IndexError" in r["error"] and "quantization_hooks.py" in r["error"], f"{label}: {r['error']}"
            assert r["group_ok"], f"{label}: the process group is unusable after the error"
