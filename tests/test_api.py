"""replicate()'s contract: in place, same class and keys, registry, what is replicated."""

import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from models import MLP
from parity import assert_grads_match, assert_same_on_every_rank, gather, seeded
from torchreplicate import ReplicateModule, replicate


def check_in_place(rank, world_size):
    model = MLP()
    keys = list(model.state_dict())
    returned = replicate(model)
    assert returned is model
    assert isinstance(model, MLP) and isinstance(model, ReplicateModule)
    assert list(model.state_dict()) == keys, "state_dict keys changed"
    state = replicate.state(model)
    assert state.param_names == tuple(name for name, _ in model.named_parameters())
    with pytest.raises(RuntimeError, match="already applied"):
        replicate(model)
    other = MLP()
    with pytest.raises(ValueError, match="not managed by replicate"):
        replicate.state(other)
    # a plain copy of the weights loads back into the replicated module
    model.load_state_dict(copy.deepcopy(model.state_dict()))
    # the subclass shows the model's own name; its qualified name says it is replicate()'s ([Note: the replicated
    # class's name] in api.py): config.json's "architectures" and repr(model) name the user's class
    assert (type(model).__name__, type(model).__qualname__) == ("MLP", "ReplicateMLP"), f"rank {rank}: {type(model)}"
    assert repr(model).startswith("MLP("), f"rank {rank}: {repr(model)[:20]}"


def test_in_place_contract(pools):
    pools.run(2, check_in_place)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.head = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        self.frozen = nn.Linear(4, 2)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.ones(4))
        self.head.register_buffer("head_scale", torch.ones(2))

    def forward(self, x):
        h = self.trunk(x) * self.scale
        return self.head(h).sum() + self.frozen(h).sum()


def check_ignored_and_frozen(rank, world_size):
    torch.manual_seed(rank)
    model = TwoHeads()
    with torch.no_grad():
        model.head.head_scale.fill_(float(rank))
    head_before = [p.detach().clone() for p in model.head.parameters()]
    replicate(model, ignored_modules=[model.head])
    names = replicate.state(model).param_names
    assert names == ("trunk.weight", "trunk.bias"), names
    # ignored parameters and buffers are not broadcast
    for (name, p), q in zip(model.head.named_parameters(), head_before):
        assert torch.equal(p, q), f"rank {rank}: ignored head.{name} was broadcast"
    assert torch.equal(model.head.head_scale, torch.full((2,), float(rank))), f"rank {rank}: head_scale was broadcast"
    x = torch.full((2, 4), float(rank + 1))
    model(x).backward()
    # the ignored head keeps its local gradient; the trunk's is averaged
    assert_same_on_every_rank(model.trunk.weight.grad, "trunk.weight.grad")
    local_heads = gather(model.head[1].weight.grad)
    assert not torch.equal(local_heads[0], local_heads[1]), f"rank {rank}: ignored module's gradient was averaged"
    assert model.frozen.weight.grad is None, f"rank {rank}: frozen.weight got a gradient"


def test_ignored_modules_and_frozen_params(pools):
    pools.run(2, check_ignored_and_frozen)


def check_fully_shard_interplay(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    sharded = MLP()
    fully_shard(sharded, mesh=mesh)
    with pytest.raises(
        RuntimeError, match="Cannot apply `replicate\\(\\)` on a Module already managed by `fully_shard`"
    ):
        replicate(sharded)

    # fully_shard child first: its parameters are skipped
    model = MLP()
    fully_shard(model.body, mesh=mesh)
    replicate(model)
    assert replicate.state(model).param_names == ("head.weight", "head.bias")

    # replicate on the root first, fully_shard on a child after: the first forward re-plans
    torch.manual_seed(rank)
    late = MLP()
    replicate(late)
    assert len(replicate.state(late).param_names) == 8
    fully_shard(late.body, mesh=mesh)
    x = torch.randn(4, 32) * (rank + 1)
    late(x).pow(2).mean().backward()
    state = replicate.state(late)
    assert state.param_names == ("head.weight", "head.bias"), state.param_names
    assert_same_on_every_rank(late.head.weight.grad, "head gradient not averaged")


def test_fully_shard_refused_skipped_and_applied_after(pools):
    pools.run(2, check_fully_shard_interplay)


def check_world_size_one_has_no_reducer(rank, world_size):
    model = MLP()
    replicate(model)
    model(torch.randn(2, 32)).sum().backward()
    assert replicate.state(model).reducer is None, "world size 1 built a reducer"
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no .grad for {missing}"


def test_world_size_one_adds_no_work(pools):
    pools.run(1, check_world_size_one_has_no_reducer)


def check_load_state_dict_assign(rank, world_size):
    model = seeded(MLP, rank)
    reference = seeded(MLP, 5)
    replicate(model)
    model(torch.randn(2, 32)).sum().backward()  # train a step first: the first forward's check is spent
    model.zero_grad()
    model.load_state_dict(copy.deepcopy(reference.state_dict()), assign=True)  # new Parameter objects
    x = torch.randn(4 * world_size, 32, generator=torch.Generator().manual_seed(0))
    model(x[4 * rank : 4 * rank + 4]).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    assert_grads_match(model, reference, f"rank {rank} after load_state_dict(assign=True)")
    assert replicate.state(model).params[0] is model.body[0].weight, (
        f"rank {rank}: the state still holds the body.0.weight that load_state_dict(assign=True) replaced"
    )


def test_load_state_dict_with_assign_re_plans(pools):
    pools.run(2, check_load_state_dict_assign)


def check_subgroup(rank, world_size):
    group = dist.new_group([1, 2])  # every rank takes part in creating it
    if rank == 0:
        return  # outside the group: nothing to replicate
    model = seeded(MLP, rank)
    reference = seeded(MLP, 1)  # group rank 0 is global rank 1: its weights win
    replicate(model, process_group=group)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    local = x[(rank - 1) * 4 : rank * 4]
    model(local).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    assert_grads_match(model, reference, f"rank {rank} in a subgroup")


def test_process_group_subgroup(pools):
    pools.run(3, check_subgroup)


def check_device_id(rank, world_size):
    model = MLP()
    replicate(model, device_id=rank)  # an int means the accelerator index; here the CPU
    other = MLP()
    replicate(other, device_id=torch.device("cpu"))
    devices = {p.device.type for p in list(model.parameters()) + list(other.parameters())}
    assert devices == {"cpu"}, f"rank {rank}: parameters on {devices}"


def test_device_id_int_on_a_cpu_machine(pools):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU fallback of an int device_id; this machine has a GPU")
    pools.run(2, check_device_id)


def check_dropped_model_is_freed(rank, world_size):
    import gc
    import weakref

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for with_hook in (False, True):
        model = nn.Sequential(MLP())
        model.register_buffer("scale", torch.ones(1))  # a buffer owned by the root itself
        replicate(model)
        if with_hook:  # a hook builds a reducer even at world size 1
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        model(torch.randn(2, 32)).sum().backward()
        model_ref, state_ref = weakref.ref(model), weakref.ref(replicate.state(model))
        del model
        gc.collect()
        where = f"rank {rank} of {world_size}, {'with' if with_hook else 'without'} a comm hook"
        assert model_ref() is None, f"{where}: the dropped model is still alive"
        assert state_ref() is None, f"{where}: the dropped model's state is still alive"


def test_dropped_model_frees_its_state(pools):
    # A state that referenced its module strongly (directly, or as the owner
    # of a buffer) kept every replicated model, its buckets and its process
    # group alive until interpreter exit: the registry maps module -> state weakly.
    for world_size in (1, 2):
        pools.run(world_size, check_dropped_model_is_freed)


def check_live_model_lets_its_group_go(rank, world_size):
    import gc
    import weakref

    group = dist.new_group(list(range(world_size)))
    model = MLP()
    replicate(model, process_group=group)
    model(torch.randn(2, 32)).sum().backward()
    group_ref = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert group_ref() is None, f"rank {rank}: the live model kept its destroyed process group alive"
    model.zero_grad()
    with pytest.raises(RuntimeError, match="process group was destroyed"):
        model(torch.randn(2, 32)).sum().backward()


def test_destroyed_group_is_freed_and_named(pools):
    # A group kept alive by a model ran gloo's threads into interpreter
    # finalization, which aborted ~1 exit in 20 (torch 2.13): held weakly.
    pools.run(2, check_live_model_lets_its_group_go)


class WrapsAModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 4)  # its own submodule named `module`: it wins

    def forward(self, x):
        return self.module(x)


class ModuleProperty(nn.Linear):
    @property
    def module(self):
        return "the class's own"


def check_model_module(rank, world_size):
    model = MLP()
    keys = list(model.state_dict())
    ddp_keys = list(torch.nn.parallel.DistributedDataParallel(MLP()).module.state_dict())
    replicate(model)
    view = model.module  # [Note: model.module] in compat/view.py
    assert view is not model and view is model.module, f"rank {rank}: model.module is not one view of the model"
    assert list(view.state_dict()) == keys == ddp_keys == list(model.state_dict()), f"rank {rank}: keys changed"
    assert all(p is q for p, q in zip(view.parameters(), model.parameters(), strict=True)), f"rank {rank}: copies"
    assert isinstance(view, MLP) and type(view).__name__ == "MLP", f"rank {rank}: {type(view)}"
    assert not hasattr(view, "module"), f"rank {rank}: the view has a .module: unwrapping loops would not end"
    assert replicate.state(view) is replicate.state(model), f"rank {rank}: the view has another state"
    view.extra = 1  # one namespace: set through the view, seen on the model
    assert model.extra == 1, f"rank {rank}: the view's attribute is not the model's"
    assert "module" not in dict(model.named_modules()), f"rank {rank}: `module` became a submodule"
    with pytest.raises(RuntimeError, match="replicate\\(\\) was already applied"):
        replicate(view)
    twin = copy.deepcopy(view)  # an EMA copy of ddp.module: a plain module, as copy.deepcopy(model) gives
    assert type(twin) is MLP and not twin._forward_pre_hooks, f"rank {rank}: the copy is a {type(twin)}"
    stamp = replicate.state(model).stamp()
    view.float()  # view.to(...) and the like re-plan at the next forward, as on the model
    assert replicate.state(model).stamp() != stamp, f"rank {rank}: view._apply was not noted"
    wrapper = WrapsAModule()
    replicate(wrapper)
    assert wrapper.module is wrapper._modules["module"], f"rank {rank}: the model's submodule lost to ours"
    assert list(wrapper.state_dict()) == ["module.weight", "module.bias"], f"rank {rank}: {list(wrapper.state_dict())}"
    own = replicate(ModuleProperty(4, 4))
    assert own.module == "the class's own", f"rank {rank}: the class's property lost to ours"
    model.module = "set by the user"  # a plain attribute wins too, and setting it works
    assert model.module == "set by the user", f"rank {rank}: {model.module!r}"
    kept, view_kept = weakref.ref(model), weakref.ref(view)
    del model, view
    gc.collect()
    assert kept() is None and view_kept() is None, f"rank {rank}: the view keeps a discarded model alive"


def test_model_module_is_the_model_seen_as_ddps_module(pools):
    # DDP code unwraps `model.module`: the same model, with DDP's keys, and no `.module` of its own.
    pools.run(2, check_model_module)


def check_failed_replicate_leaves_no_registration(rank, world_size):
    from torch.distributed._composable.contract import _get_registry

    model = MLP()
    errors = []
    for _ in range(2):  # refused the same way twice: the first left no "already applied"
        with pytest.raises(RuntimeError) as info:
            replicate(model, bucket_cap_mb=25 if rank == 0 else 10)  # the ranks disagree: refused at set-up
        errors.append(str(info.value))
    assert all("with different bucket_cap_mb" in e for e in errors), f"rank {rank}: {errors}"
    assert "replicate" not in (_get_registry(model) or {}), f"rank {rank}: torch's registry still holds it"
    with pytest.raises(ValueError, match="not managed by replicate"):
        replicate.state(model)
    assert type(model) is MLP, f"rank {rank}: the class was swapped: {type(model)}"
    replicate(model)  # agreed options: now it works, and torch's registry says so (what fully_shard reads)
    assert "replicate" in (_get_registry(model) or {}), f"rank {rank}: not in torch's registry"
    twin = copy.deepcopy(model)  # a plain module: no registry entry, so it can be replicated again
    assert "replicate" not in (_get_registry(twin) or {}), f"rank {rank}: the copy kept the registry entry"
    replicate(twin)


def test_a_failed_replicate_leaves_no_registration(pools):
    # [Note: the registry] in core/registry.py: the entry in torch's registry is undone with the set-up
    pools.run(2, check_failed_replicate_leaves_no_registration)
