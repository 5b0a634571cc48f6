"""DDP's constructor arguments: each one through DDP and through replicate(), compared.

One row per argument value of DDP's signature (2.13's, and 2.15's lazy_bucket_allocation). "same": both accept and,
after one step on each rank's slice, every rank's parameters and averaged
gradients are equal between DDP and ours. Otherwise the row says which side
refuses and why (DDP's refusals on a CPU module come first in ours' text where
ours refuses too). Runs on 2 gloo ranks; every rank checks its own result.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, NamedTuple, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

from ddp_versions import CUDA_BUILD_WITHOUT_GPU, DDP_ARGUMENTS, skip_unless_ddp_has
from models import MLP
from torchreplicate import replicate

SAME = "same"  # both accept, equal results
BOTH_REFUSE = "both refuse"  # same type, DDP's text first in ours


class Row(NamedTuple):
    arguments: Callable[[nn.Module], dict[str, Any]]  # built from the model, on each rank
    expect: str  # SAME, BOTH_REFUSE, or what differs and why
    ddp_error: Optional[type] = None
    ours_error: Optional[type] = None
    per_rank_init: bool = False  # ranks start from different weights (init_sync rows)


def mesh_1d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def kw(**arguments: Any) -> Callable[[nn.Module], dict[str, Any]]:
    return lambda model: arguments


ROWS: dict[str, Row] = {
    "device_ids=None": Row(kw(device_ids=None), SAME),
    "device_ids=[]": Row(kw(device_ids=[]), SAME),
    "device_ids=[0]": Row(kw(device_ids=[0]), "DDP refuses a CPU module; ours: index 0 is the CPU here", ValueError),
    "device_ids=[0, 1]": Row(kw(device_ids=[0, 1]), BOTH_REFUSE, ValueError, ValueError),
    "output_device=None": Row(kw(output_device=None), SAME),
    "output_device=0": Row(kw(output_device=0), SAME),  # DDP tests `if output_device`: 0 passes; ours: the CPU here
    "output_device=meta": Row(
        kw(output_device=torch.device("meta")), "both refuse, for different reasons", ValueError, ValueError
    ),
    "dim=0": Row(kw(dim=0), SAME),
    "dim=1": Row(kw(dim=1), SAME),  # no effect in either (ours warns)
    "broadcast_buffers=None": Row(kw(broadcast_buffers=None), SAME),
    "broadcast_buffers=True": Row(kw(broadcast_buffers=True), SAME),
    "broadcast_buffers=False": Row(kw(broadcast_buffers=False), SAME),
    "init_sync=True": Row(kw(init_sync=True), SAME, per_rank_init=True),
    "init_sync=False": Row(kw(init_sync=False), SAME, per_rank_init=True),
    "process_group=WORLD": Row(lambda model: {"process_group": dist.group.WORLD}, SAME),
    "bucket_cap_mb=1": Row(kw(bucket_cap_mb=1), SAME),
    "find_unused_parameters=True": Row(kw(find_unused_parameters=True), SAME),
    "check_reduction=True": Row(kw(check_reduction=True), SAME),
    "gradient_as_bucket_view=False": Row(kw(gradient_as_bucket_view=False), SAME),
    "gradient_as_bucket_view=True": Row(kw(gradient_as_bucket_view=True), SAME),
    "static_graph=True": Row(kw(static_graph=True), SAME),
    "delay_all_reduce_named_params and param_to_hook_all_reduce": Row(
        lambda model: {  # DDP's meaning holds when the hooked gradient is the last one computed
            "delay_all_reduce_named_params": [("head.weight", model.head.weight)],
            "param_to_hook_all_reduce": model.body[0].weight,
        },
        SAME,
    ),
    "delay_all_reduce_named_params alone": Row(
        lambda model: {"delay_all_reduce_named_params": [("body.0.weight", model.body[0].weight)]},
        BOTH_REFUSE,
        ValueError,
        ValueError,
    ),
    "mixed_precision": Row(
        kw(mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16)),
        "DDP fails on CPU (no events); ours refuses: use mp_policy=",
        RuntimeError,
        ValueError,
    ),
    "device_mesh=1-D": Row(lambda model: {"device_mesh": mesh_1d()}, SAME),
    "skip_all_reduce_unused_params=True": Row(kw(skip_all_reduce_unused_params=True), SAME),
    "bucket_cap_mb_list=[1]": Row(kw(bucket_cap_mb_list=[1]), SAME),
    "bucket_cap_mb_list=[1, 2]": Row(kw(bucket_cap_mb_list=[1, 2]), "ours: no per-bucket caps", None, ValueError),
    "batched_grad_copy=True": Row(kw(batched_grad_copy=True), SAME),
    "forward_sync_buffers=False": Row(kw(forward_sync_buffers=False), SAME),
    "lazy_bucket_allocation=True": Row(kw(lazy_bucket_allocation=True), SAME),  # DDP 2.15's; ours warns
}


def build(rank: int, per_rank_init: bool) -> nn.Module:
    torch.manual_seed(rank if per_rank_init else 0)
    return MLP()


def one_step(model: nn.Module, rank: int, settle: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(100 + rank)  # each rank its own slice
    model(torch.randn(4, 32)).square().sum().backward()
    if settle:
        # DDP 2.13 launches the delayed parameters' all-reduce with async_op=True and
        # never waits for it (distributed.py, _delayed_all_reduce_hook): its .grad is
        # final only once that collective is done. A barrier queues behind it; the
        # sleep covers gloo running the two on different threads.
        dist.barrier()
        time.sleep(0.5)
    return [t.detach().clone() for p in model.parameters() for t in (p, p.grad)]


def construct(api: Callable[..., Any], rank: int, row: Row) -> tuple[Optional[Exception], list[torch.Tensor]]:
    model = build(rank, row.per_rank_init)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arguments = row.arguments(model)
            settle = api is DDP and "param_to_hook_all_reduce" in arguments
            return None, one_step(api(model, **arguments), rank, settle)
    except Exception as error:  # what each side raises, at set-up or in the first step, is the point here
        return error, []


def check_argument(rank: int, world_size: int, name: str) -> str:
    row = ROWS[name]
    ddp_error, ddp_values = construct(DDP, rank, row)
    ours_error, ours_values = construct(replicate, rank, row)
    where = f"rank {rank}, {name}: DDP raised {ddp_error!r}, ours {ours_error!r}"
    assert type(ddp_error) is row.ddp_error if row.ddp_error else ddp_error is None, where
    assert isinstance(ours_error, row.ours_error) if row.ours_error else ours_error is None, where
    if row.expect == BOTH_REFUSE:
        assert str(ours_error).startswith(str(ddp_error)), f"{where}: DDP's text is not first"
    if row.expect == SAME:
        for ddp_value, ours_value in zip(ddp_values, ours_values, strict=True):
            torch.testing.assert_close(ours_value, ddp_value, rtol=1e-6, atol=1e-7, msg=where)
    return type(ours_error).__name__


@pytest.mark.parametrize("name", list(ROWS))
def test_ddp_argument_through_both(pools, name):
    skip_unless_ddp_has(name.split("=")[0].split(" ")[0])  # the row's DDP argument
    if name == "mixed_precision" and CUDA_BUILD_WITHOUT_GPU:
        pytest.skip(
            "DDP's mixed_precision makes a torch.Stream() at construction, which a CUDA build raises on "
            "without a GPU (this torch's CUDA build here); checked on the CPU build of torch 2.13"
        )
    per_rank = pools.run(2, check_argument, name)
    assert per_rank[0] == per_rank[1], f"{name}: the ranks differ: {per_rank}"


def test_every_ddp_argument_has_a_row():
    names = set(DDP_ARGUMENTS)
    covered = {name.split("=")[0].split(" ")[0] for name in ROWS} | {"param_to_hook_all_reduce"}
    assert names <= covered, f"DDP arguments without a row: {sorted(names - covered)}"


def test_positional_options_name_their_keyword():
    with pytest.raises(TypeError) as info:
        replicate(MLP(), [0], None)
    message = str(info.value)
    assert message.startswith("replicate() takes 1 positional argument but 3 were given")
    assert "device_ids=[0], <option>=None" in message


def test_unknown_keyword_suggests_one():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bucket_cap'; did you mean bucket_cap_mb=\?"):
        replicate(MLP(), bucket_cap=25)


def test_mixed_precision_points_to_mp_policy():
    with pytest.raises(ValueError, match=r"mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy\(param_dtype="):
        replicate(MLP(), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))


def test_no_effect_arguments_warn():
    for arguments in (
        {"dim": 1},
        {"check_reduction": True},
        {"batched_grad_copy": True},
        {"lazy_bucket_allocation": 1},
    ):
        with pytest.warns(UserWarning, match="has no effect"):
            with pytest.raises(RuntimeError, match="init_process_group"):
                replicate(MLP(), **arguments)
