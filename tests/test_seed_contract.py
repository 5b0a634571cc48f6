"""The seed's contract: torch's own replicate and ours, side by side on the same input.

One row per refusal of the seed (``torch.distributed._composable.replicate``,
which builds a DDP at the first forward, so DDP's constructor refusals are
the seed's too). Where both refuse, ours raises an exception of the seed's
type with the seed's message first ([Note: the seed's contract] in
errors.py). The rows after that pin where they knowingly differ.
Every row runs on 2 gloo ranks and checks each rank's error.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, NamedTuple, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchreplicate import replicate

SAME_TEXT = "the seed's message first"
SAME_TYPE = "the seed's type"


class Row(NamedTuple):
    build: Callable[[], tuple[nn.Module, dict[str, Any]]]  # a fresh model and the options, per call
    seed: Optional[type]  # what the seed raises (None: it accepts)
    ours: Optional[type]  # what ours raises besides (None: it accepts)
    match: str  # SAME_TEXT, SAME_TYPE, or why the two differ


def linear() -> nn.Module:
    return nn.Linear(4, 4)


def fully_sharded() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = linear()
    fully_shard(model)
    return model


def half_on_meta() -> nn.Module:
    model = nn.Sequential(linear(), linear())
    model[1].to("meta")
    return model


def frozen() -> nn.Module:
    return linear().requires_grad_(False)


def mesh_1d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def mesh_2d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))


ROWS: dict[str, Row] = {
    # -- both refuse: the seed's type, the seed's text first
    "device_id list": Row(lambda: (linear(), {"device_id": [torch.device("cpu")]}), RuntimeError, TypeError, SAME_TEXT),
    "device_id str": Row(lambda: (linear(), {"device_id": "cpu"}), RuntimeError, TypeError, SAME_TEXT),
    "device_id float": Row(lambda: (linear(), {"device_id": 1.5}), RuntimeError, TypeError, SAME_TEXT),
    "applied twice": Row(lambda: (linear(), {"_twice": True}), AssertionError, RuntimeError, SAME_TEXT),
    "fully_shard": Row(lambda: (fully_sharded(), {}), RuntimeError, RuntimeError, SAME_TEXT),
    "ignored_modules a module": Row(
        lambda: (linear(), {"ignored_modules": nn.Linear(2, 2)}), TypeError, TypeError, SAME_TEXT
    ),
    "ignored_modules an int": Row(lambda: (linear(), {"ignored_modules": 3}), TypeError, TypeError, SAME_TEXT),
    "process_group and device_mesh": Row(
        lambda: (linear(), {"process_group": dist.group.WORLD, "device_mesh": mesh_1d()}),
        RuntimeError,
        ValueError,
        SAME_TEXT,
    ),
    "device_mesh 2-D": Row(lambda: (linear(), {"device_mesh": mesh_2d()}), RuntimeError, ValueError, SAME_TEXT),
    "device_ids two": Row(lambda: (linear(), {"device_ids": [0, 1]}), ValueError, ValueError, SAME_TEXT),
    "delay_all_reduce alone": Row(
        lambda: (linear(), {"delay_all_reduce_named_params": []}), ValueError, ValueError, SAME_TEXT
    ),
    "param_to_hook alone": Row(
        lambda: (linear(), {"param_to_hook_all_reduce": nn.Parameter(torch.zeros(1))}),
        ValueError,
        ValueError,
        SAME_TEXT,
    ),
    "two device types": Row(lambda: (half_on_meta(), {}), ValueError, ValueError, SAME_TEXT),
    # both refuse, the text differs: DDP's names its class, its index check depends on the device
    "unknown keyword": Row(lambda: (linear(), {"foo": 1}), TypeError, TypeError, SAME_TYPE),
    "positional process_group": Row(
        lambda: (linear(), {"_positional": dist.group.WORLD}), TypeError, TypeError, SAME_TYPE
    ),
    "device_id negative": Row(lambda: (linear(), {"device_id": -1}), ValueError, ValueError, SAME_TYPE),
    "device_id bool": Row(lambda: (linear(), {"device_id": True}), ValueError, TypeError, SAME_TYPE),
    # -- where they knowingly differ (the reason is the row's text)
    "not a module: a list": Row(
        lambda: ([linear(), linear()], {}),
        AttributeError,
        TypeError,
        "the seed crashes by accident ('list' has no __dict__)",
    ),
    "not a module: a tensor": Row(
        lambda: (torch.zeros(3), {}), AttributeError, TypeError, "the seed crashes by accident (no .modules)"
    ),
    "ignored_modules holds a str": Row(
        lambda: (linear(), {"ignored_modules": ["head"]}), AttributeError, TypeError, "the seed crashes at forward"
    ),
    "device_id None": Row(lambda: (linear(), {"device_id": None}), RuntimeError, None, "None is ours' default"),
    "device_id int, no accelerator": Row(
        lambda: (linear(), {"device_id": 0}), ValueError, None, "an int means the CPU where there is no accelerator"
    ),
    "nothing to train": Row(
        lambda: (frozen(), {}), RuntimeError, None, "parameters may be unfrozen later; a parent of replicated blocks"
    ),
    "a lazy child": Row(
        lambda: (nn.Sequential(nn.LazyLinear(4)), {}),
        RuntimeError,
        None,
        "ours materialises it at the first forward and broadcasts it then (core/lazy.py)",
    ),
    "lazy root": Row(
        lambda: (nn.LazyLinear(4), {}),
        None,
        ValueError,
        "torch replaces a lazy root's class when it materialises, dropping replicate()'s methods",
    ),
}


def outcome(fn: Callable[[], Any]) -> Optional[BaseException]:
    try:
        fn()
    except Exception as error:  # what each side raises is the point here
        return error
    return None


def call(api: Callable[..., Any], model: Any, options: dict[str, Any], forward: bool) -> None:
    options = dict(options)
    positional = (options.pop("_positional"),) if "_positional" in options else ()
    twice = options.pop("_twice", False)
    api(model, *positional, **options)
    if twice:
        api(model, **options)
    if forward:  # the seed builds its DDP, and so raises DDP's refusals, at the first forward
        model(torch.randn(2, 4))


def check_row(rank: int, world_size: int, name: str) -> tuple[str, str]:
    from torch.distributed._composable.replicate import replicate as seed

    row = ROWS[name]
    seed_error = outcome(lambda: call(seed, *row.build(), forward=True))
    ours_error = outcome(lambda: call(replicate, *row.build(), forward=False))
    where = f"rank {rank}, {name!r}: seed raised {seed_error!r}, ours {ours_error!r}"
    assert type(seed_error) is row.seed if row.seed else seed_error is None, where
    assert isinstance(ours_error, row.ours) if row.ours else ours_error is None, where
    if row.match in (SAME_TEXT, SAME_TYPE):
        assert isinstance(ours_error, row.seed), f"{where}: not the seed's type"  # type: ignore[arg-type]
    if row.match == SAME_TEXT:
        # the seed's subclass prints as DDPLinear, ours as the model's own Linear ([Note: the replicated class's name])
        seed_text = str(seed_error).replace("DDPLinear(", "Linear(")
        assert str(ours_error).startswith(seed_text), f"{where}: the seed's text is not first"
        assert "replicate():" in str(ours_error)[len(seed_text) :], f"{where}: our clearer text does not follow"
    return type(seed_error).__name__, type(ours_error).__name__


@pytest.mark.parametrize("name", list(ROWS))
def test_seed_and_ours_side_by_side(pools, name):
    per_rank = pools.run(2, check_row, name)
    assert per_rank[0] == per_rank[1], f"{name}: the ranks raised differently: {per_rank}"


def test_deepcopy_differs_on_purpose(pools):
    pools.run(2, check_deepcopy)


def check_deepcopy(rank, world_size):
    # The seed refuses deepcopy (AssertionError); ours copies a plain module
    # (an EMA or teacher copy): a deliberate difference, pinned here.
    from torch.distributed._composable.replicate import replicate as seed

    error = outcome(lambda: copy.deepcopy(seed(linear())))
    assert isinstance(error, AssertionError) and "deepcopy" in str(error), f"rank {rank}: {error!r}"
    twin = copy.deepcopy(replicate(linear()))
    assert type(twin) is nn.Linear, f"rank {rank}: the copy is a {type(twin).__name__}"
