"""DDP's configuration attributes and internals on a replicated module, against torch DDP 2.13.

The fourteen public attributes of a DDP instance that a replicated module
used to lack, and DDP's private ``_register_builtin_comm_hook``: each answers
as DDP's does on the same job, or raises an ``AttributeError`` saying why
there is no such thing here and what to use (compat/ddp_surface.py's
``DDPInternals``; the table in docs/migration.md).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_versions import ADDED_BY_213, TORCH_RELEASE
from torchreplicate import replicate
from torchreplicate.compat.ddp_surface import NOT_HERE, DDPInternals

# The attributes issue 38 found missing, as DDP 2.13 names them.
DDP_ATTRIBUTES = (
    *("reducer", "logger", "device", "mixed_precision", "modules_buffers", "named_module_buffers", "to_kwargs"),
    *("is_multi_device_module", "broadcast_bucket_size", "bucket_bytes_cap_default", "bucket_bytes_cap_list"),
    *("skip_all_reduce_unused_params", "batched_grad_copy", "use_side_stream_for_tensor_copies"),
)
PROVIDED = (
    *("device", "mixed_precision", "is_multi_device_module", "bucket_bytes_cap_default"),
    *("modules_buffers", "named_module_buffers"),
)


def test_each_attribute_is_provided_or_says_why_not():
    provided = {name for name in DDP_ATTRIBUTES if name in vars(DDPInternals)}
    assert provided == set(PROVIDED)
    assert set(DDP_ATTRIBUTES) - provided == set(NOT_HERE), "each of DDP's attributes: provided, or in NOT_HERE"
    for name, why in NOT_HERE.items():
        assert why.count(";") + why.count(":") >= 1 and len(why) > 60, f"{name}: say why there is none, and what to use"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


def net(ignored: tuple[str, ...] = ()) -> Net:
    torch.manual_seed(0)
    model = Net()
    if ignored:
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(ignored))
    return model


def step(model: nn.Module, rank: int, index: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + index)) + rank
    model(x).square().mean().backward()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def attributes_as_ddp(rank, world_size):
    for ignored in ((), ("norm.running_mean", "body.bias")):
        ours, wrapped = replicate(net(ignored)), DDP(net(ignored))
        for name in ("device", "mixed_precision", "is_multi_device_module", "bucket_bytes_cap_default"):
            assert getattr(ours, name) == getattr(wrapped, name), f"{name}: {getattr(ours, name)!r}"
        assert list(ours.named_module_buffers) == [n for n in wrapped.named_module_buffers], ignored
        assert all(a is b for a, b in zip(ours.modules_buffers, ours.named_module_buffers.values()))
        theirs = [b.clone() for b in wrapped.modules_buffers]
        assert all(torch.equal(a, b) for a, b in zip(ours.modules_buffers, theirs))
        assert "norm.running_mean" not in ours.named_module_buffers or not ignored
    # a bucket cap given: DDP's first bucket then takes it too; here first_bucket_cap_mb still applies
    assert replicate(net(), bucket_cap_mb=4, first_bucket_cap_mb=4).bucket_bytes_cap_default is False
    assert DDP(net(), bucket_cap_mb=4).bucket_bytes_cap_default is False

    for name in NOT_HERE:  # DDP has each of them; a replicated module says why not, naming what to use
        if name not in ADDED_BY_213 or hasattr(DDP(net()), name):  # an older DDP lacks those (ddp_versions.py)
            assert hasattr(DDP(net()), name), f"DDP {TORCH_RELEASE} has no {name}: drop it from NOT_HERE"
        with pytest.raises(AttributeError, match=rf"^replicate\(\): 'Net' has no attribute '{name}': it is "):
            getattr(ours, name)
        assert not hasattr(ours, name)
    for name in PROVIDED:
        with pytest.raises(AttributeError, match=f"{name} is DDP's attribute, read-only.*DDP's configuration"):
            setattr(ours, name, None)
    with pytest.raises(AttributeError, match="object has no attribute 'no_such_thing'"):
        ours.no_such_thing  # noqa: B018 (the lookup is the test)

    # the model's own names win, as for DDP's other names
    own = net()
    own.logger = "mine"
    own.device = "also mine"
    own.reducer = nn.Linear(1, 1)  # a submodule: nn.Module's own lookup finds it
    replicate(own)
    assert own.logger == "mine" and own.device == "also mine" and isinstance(own.reducer, nn.Linear)

    # DDP's two built-in hooks: the stock Python hooks, the same sums
    for hook_type in (dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS):
        ours, wrapped = replicate(net(), gradient_as_bucket_view=False), DDP(net())
        ours._register_builtin_comm_hook(hook_type)
        wrapped._register_builtin_comm_hook(hook_type)
        for index in range(2):
            ours.zero_grad()
            wrapped.zero_grad()
            step(ours, rank, index)
            step(wrapped, rank, index)
            mine, theirs = grads(ours), grads(wrapped)
            assert mine and mine.keys() == theirs.keys()
            for name, grad in mine.items():
                assert torch.equal(grad, theirs[name]), f"{hook_type}: {name} differs from DDP's"
    with pytest.raises(ValueError, match="two built-in hooks.*register_comm_hook"):
        replicate(net())._register_builtin_comm_hook("FP16_COMPRESS")


def test_attributes_as_ddp(pools):
    pools.run(2, attributes_as_ddp)


def test_the_refusals_describe_what_replicate_does_instead():
    # each message's claim, against the code that does it (issue 60: three of them once said otherwise)
    from torchreplicate.config import MiB, ReplicateConfig
    from torchreplicate.core import buffers
    from torchreplicate.core.state import ReplicateState

    assert buffers.CHUNK_BYTES == 250 * MiB and "in the same 250 MiB pieces" in NOT_HERE["broadcast_bucket_size"]
    for name in ("to_kwargs", "use_side_stream_for_tensor_copies"):
        assert "moves" in NOT_HERE[name] and "device_id" in NOT_HERE[name], NOT_HERE[name]
        assert "copies no inputs" not in NOT_HERE[name] and "as given" not in NOT_HERE[name], NOT_HERE[name]
    # inputs move to an accelerator device_id (a meta device stands in for one here), never to the CPU
    for device_id, moved_to in ((torch.device("meta"), torch.device("meta")), (torch.device("cpu"), None)):
        state = ReplicateState(nn.Linear(1, 1), ReplicateConfig(device_id=device_id))
        assert state.input_device == moved_to, (device_id, state.input_device)
