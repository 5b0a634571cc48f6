"""DDP's attributes and methods on a replicated module, against torch DDP on the same job.

Every multi-rank check runs DDP and replicate() side by side on rank-different
inputs (and rank-different initial values where set-up matters), so a missing
or extra average or broadcast shows.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_versions import ddp_attribute, set_ddp_attribute
from parity import gather, same_on_every_rank
from torchreplicate import replicate

IGNORED = ["tables.weight", "tables.bias", "norm.running_mean"]  # DDP's ignore list, by fully qualified name


class Ranker(nn.Module):
    """A shared body, a "sharded table" (torchrec keeps it out of DDP) and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.Linear(6, 6)
        self.body = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x) + self.tables(x)))


def rank_model(rank: int) -> Ranker:
    """The same weights on every rank, except the ignored table and statistics: rank-different."""
    torch.manual_seed(0)
    model = Ranker()
    with torch.no_grad():
        model.tables.weight.add_(rank)
        model.tables.bias.add_(rank)
        model.norm.running_mean.add_(rank)
        model.norm.running_var.add_(rank)  # not ignored: broadcast at set-up by both
    return model


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * rank + step)) + rank


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, their gradients and buffers, by name (names without DDP's ``module.``)."""
    tensors = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    tensors |= {f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    tensors |= {f"buffer {n}": b.clone() for n, b in model.named_buffers()}
    return {name.replace("module.", "", 1): t for name, t in tensors.items()}


def assert_as_ddp(ours: nn.Module, theirs: nn.Module, where: str) -> None:
    """Bitwise equal parameters, gradients and buffers (2 ranks: the same sums in the same order)."""
    mine, ddp = state_of(ours), state_of(theirs)
    assert mine.keys() == ddp.keys(), f"{where}: {sorted(mine.keys() ^ ddp.keys())}"
    for name, tensor in mine.items():
        assert torch.equal(tensor, ddp[name]), f"{where}: {name} differs from DDP's: {tensor} vs {ddp[name]}"


def train(model: nn.Module, rank: int, steps: range) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        optimizer.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        optimizer.step()


def ignored_before_replicate(rank, world_size):
    """Set before wrapping (torchrec's way): not broadcast at set-up, not averaged, as DDP."""
    ours, theirs = rank_model(rank), rank_model(rank)
    for model in (ours, theirs):
        DDP._set_params_and_buffers_to_ignore_for_model(model, IGNORED)
    replicate(ours)
    wrapped = DDP(theirs)
    assert_as_ddp(ours, wrapped, f"rank {rank}, after set-up")
    assert not same_on_every_rank(ours.tables.weight), "the ignored table was broadcast at set-up"
    assert same_on_every_rank(ours.norm.running_var), "a buffer not ignored was not broadcast at set-up"
    for step in range(3):
        train(ours, rank, range(step, step + 1))
        train(wrapped, rank, range(step, step + 1))
        assert_as_ddp(ours, wrapped, f"rank {rank}, step {step}")
    assert not same_on_every_rank(ours.tables.weight.grad), "the ignored table's gradient was averaged"
    assert same_on_every_rank(ours.body.weight.grad), "a replicated gradient was not averaged"
    assert "tables.weight" not in replicate.state(ours).param_names


def test_ignored_parameters_and_buffers_as_ddp(pools):
    pools.run(2, ignored_before_replicate)


def ignored_after_replicate(rank, world_size):
    """Set after replicate(): the next forward re-plans without them; then the steps equal DDP's."""
    ours, theirs = rank_model(0), rank_model(0)  # equal everywhere: set-up broadcasts do not tell
    DDP._set_params_and_buffers_to_ignore_for_model(theirs, IGNORED)
    wrapped = DDP(theirs)
    replicate(ours)
    assert "tables.weight" in replicate.state(ours).param_names
    DDP._set_params_and_buffers_to_ignore_for_model(ours, IGNORED)  # sets ours._ddp_params_and_buffers_to_ignore
    assert ours._ddp_params_and_buffers_to_ignore == IGNORED
    for step in range(3):
        train(ours, rank, range(step, step + 1))
        train(wrapped, rank, range(step, step + 1))
        assert_as_ddp(ours, wrapped, f"rank {rank}, step {step}")
    assert "tables.weight" not in replicate.state(ours).param_names
    assert not same_on_every_rank(ours.tables.weight), "the ignored table was averaged after all"
    del ours._ddp_params_and_buffers_to_ignore  # back to averaging everything at the next forward
    train(ours, rank, range(9, 10))
    assert "tables.weight" in replicate.state(ours).param_names
    assert same_on_every_rank(ours.tables.weight.grad), "no longer ignored, yet not averaged"


def test_ignore_list_set_after_replicate_re_plans(pools):
    pools.run(2, ignored_after_replicate)


def ignore_list_checked(rank, world_size):
    model = rank_model(0)
    model._ddp_params_and_buffers_to_ignore = "tables.weight"
    with pytest.raises(TypeError, match="single string 'tables.weight'.*write a list"):
        replicate(model)
    del model._ddp_params_and_buffers_to_ignore
    model._ddp_params_and_buffers_to_ignore = ["tables.wieght"]
    with pytest.warns(UserWarning, match=r"\['tables.wieght'\].*match no parameter or buffer"):
        replicate(model)
    assert "tables.weight" in replicate.state(model).param_names
    with pytest.raises(TypeError, match="fully qualified names .str., got 3"):
        model._ddp_params_and_buffers_to_ignore = [3]
    plain = copy.deepcopy(model)  # a copy is a plain module and keeps the list, as a plain module would
    assert type(plain) is Ranker and plain._ddp_params_and_buffers_to_ignore == ["tables.wieght"]
    assert gather(torch.ones(1))  # every rank got here


def test_ignore_list_is_checked(pools):
    pools.run(2, ignore_list_checked)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))  # a parameter of the root module itself
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.scale)


def root_parameter_ignored(rank, world_size):
    """A listed parameter of the root itself is left alone too (DDP 2.13's reducer averages it: docs/migration.md)."""
    torch.manual_seed(0)
    model = Scaled()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["scale"])
    replicate(model)
    model(batch(rank, 0)).sum().backward()
    assert replicate.state(model).param_names == ("lin.weight", "lin.bias")
    assert not same_on_every_rank(model.scale.grad), "the listed root parameter was averaged"
    assert same_on_every_rank(model.lin.weight.grad)


def test_a_listed_root_parameter_is_left_alone(pools):
    pools.run(2, root_parameter_ignored)


SAME_VALUE = (
    "device_ids",
    "output_device",
    "dim",
    "broadcast_buffers",
    "forward_sync_buffers",
    "find_unused_parameters",
    "static_graph",
    "require_backward_grad_sync",
    "require_forward_param_sync",
    "gradient_as_bucket_view",
    "bucket_bytes_cap",
    "device_type",
)


def assert_same_surface(ours: nn.Module, wrapped: DDP, where: str) -> None:
    for name in SAME_VALUE:
        mine, theirs = getattr(ours, name), ddp_attribute(wrapped, name)
        assert mine == theirs, f"{where}: {name} is {mine!r}, DDP's {theirs!r}"
    assert ours.will_sync_module_buffers() == wrapped.will_sync_module_buffers(), f"{where}: will_sync_module_buffers"
    assert set(ours.parameters_to_ignore) == wrapped.parameters_to_ignore, f"{where}: parameters_to_ignore"
    assert ours.process_group is wrapped.process_group, f"{where}: process_group"


def one_step(runners: tuple[nn.Module, ...], rank: int, step: int) -> None:
    for runner in runners:
        runner(batch(rank, step)).square().mean().backward()


def surface_as_ddp(rank, world_size):
    """Every DDP attribute and method: DDP's value, and DDP's effect, on the same job."""
    ours, theirs = rank_model(rank), rank_model(rank)
    for model in (ours, theirs):
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["tables.weight"])
    replicate(ours, gradient_as_bucket_view=False)  # DDP's default, so the value compares
    wrapped = DDP(theirs)
    assert_same_surface(ours, wrapped, f"rank {rank}, after set-up")
    mine, ddp = ours._get_ddp_logging_data(), wrapped._get_ddp_logging_data()
    for key, value in mine.items():
        assert value == ddp[key], f"rank {rank}: _get_ddp_logging_data()[{key!r}] is {value!r}, DDP's {ddp[key]!r}"
    with ours.no_sync(), wrapped.no_sync():
        one_step((ours, wrapped), rank, 0)
        assert_same_surface(ours, wrapped, f"rank {rank}, after a forward under no_sync")  # no broadcast due
    one_step((ours, wrapped), rank, 1)
    assert_same_surface(ours, wrapped, f"rank {rank}, after a synced step")
    assert_as_ddp(ours, wrapped, f"rank {rank}, after a synced step")
    # DDP's run-time switches, set on both: the buffers follow, as DDP's
    for runner in (ours, wrapped):
        runner.require_forward_param_sync = False  # the next forward skips the buffer broadcast
    assert_same_surface(ours, wrapped, f"rank {rank}, require_forward_param_sync=False")
    one_step((ours, wrapped), rank, 2)
    assert_as_ddp(ours, wrapped, f"rank {rank}, after a forward with require_forward_param_sync=False")
    for runner in (ours, wrapped):
        runner.broadcast_buffers = False
    one_step((ours, wrapped), rank, 3)
    assert_same_surface(ours, wrapped, f"rank {rank}, broadcast_buffers=False")
    assert_as_ddp(ours, wrapped, f"rank {rank}, after a forward with broadcast_buffers=False")
    ours.forward_sync_buffers = True
    set_ddp_attribute(wrapped, "forward_sync_buffers", True)
    one_step((ours, wrapped), rank, 4)
    assert_as_ddp(ours, wrapped, f"rank {rank}, forward_sync_buffers=True again")

    for runner in (ours, wrapped):  # after training started: refused by both, DDP's message first
        with pytest.raises(RuntimeError, match=r"set_static_graph\(\) should be called before training loop starts"):
            runner._set_static_graph()

    # _set_static_graph() before training: accepted (it changes nothing here), as DDP
    ours, wrapped = replicate(rank_model(0)), DDP(rank_model(0))
    with pytest.warns(UserWarning, match="static_graph=True has no effect"):
        ours._set_static_graph()
    wrapped._set_static_graph()
    assert ours.static_graph is True and wrapped.static_graph is True
    one_step((ours, wrapped), rank, 5)
    assert_as_ddp(ours, wrapped, f"rank {rank}, a step after _set_static_graph()")
    for runner in (ours, wrapped):  # again, after training: only a warning, as DDP
        with pytest.warns(UserWarning, match="no need to set it again"):
            runner._set_static_graph()


def test_surface_as_ddp(pools):
    pools.run(2, surface_as_ddp)


class OwnNames(nn.Module):
    """A model with its own attributes under DDP's names: they win."""

    def __init__(self) -> None:
        super().__init__()
        self.dim = 512
        self.device_type = nn.Linear(2, 2)  # a submodule
        self.lin = nn.Linear(2, 2)

    def gather(self) -> str:
        return "mine"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.device_type(x))


def refusals_and_own_names(rank, world_size):
    model = replicate(Ranker())
    for name, value, fix in (
        ("process_group", None, "process_group= or mesh="),
        ("bucket_bytes_cap", 1, "bucket_cap_mb="),
        ("gradient_as_bucket_view", False, "gradient_as_bucket_view="),
        ("device_ids", [0], "device_id="),
        ("find_unused_parameters", True, "always handled"),
        ("static_graph", True, "_set_static_graph"),
        ("parameters_to_ignore", {"head.weight"}, "_ddp_params_and_buffers_to_ignore"),
    ):
        with pytest.raises(AttributeError, match=f"{name} is DDP's attribute.*{fix}"):
            setattr(model, name, value)
    with pytest.raises(TypeError, match=r"broadcast_buffers \(forward_sync_buffers\) must be True or False, got 'yes'"):
        model.broadcast_buffers = "yes"
    with pytest.raises(RuntimeError, match=r"_register_fused_optim\(SGD.*_apply_optimizer_in_backward"):
        model._register_fused_optim(torch.optim.SGD, lr=0.1)
    with pytest.raises(AssertionError, match="Gather function not implemented for CPU"):  # as DDP's, on the CPU
        model.gather([torch.ones(1)], -1)
    model(batch(rank, 0)).sum().backward()
    if rank == 0:  # one rank evaluates alone: no collective; DDP's rule clears its switch (docs/migration.md)
        with torch.no_grad():
            model.eval()(batch(rank, 1))
    assert model.require_forward_param_sync == model.will_sync_module_buffers() == (rank != 0)
    seen = []  # the statistics BatchNorm starts from: after the root's buffers came, before its own update
    model.norm.register_forward_pre_hook(lambda module, args: seen.append(module.running_var.clone()))
    model.train()(batch(rank, 2)).sum().backward()  # rank 1 takes rank 0's, sent before its evaluation
    assert same_on_every_rank(seen[0]), "the forward after rank 0's evaluation runs on other buffers"
    assert model.require_forward_param_sync, "a forward with gradients sets the switch again"
    own = replicate(OwnNames())
    assert own.dim == 512 and own.gather() == "mine" and isinstance(own.device_type, nn.Linear)
    own.dim = 3  # the model's own attribute: a plain assignment
    assert own.dim == 3
    assert own.process_group is replicate.state(own).group  # DDP's names it does not have are DDP's


def test_refusals_and_the_model_s_own_names(pools):
    pools.run(2, refusals_and_own_names)
