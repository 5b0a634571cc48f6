"""Training patterns from real code: exact against one process on the global batch, or a clear error on every rank.

Each rank function trains a replica and a single-process reference that
sees every rank's data, asserts inside the rank (naming rank, step and
parameter), and returns what the test compares across ranks.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Callable, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import parity
from models import DIM, MLP, data
from models import TINY_DIM_BUCKETS as TINY
from parity import assert_grads_match, digest, seeded
from torchreplicate import ReplicateModule, replicate


class Net(nn.Module):
    """A trunk, a buffer, a head and an output layer (no batch statistics: the
    replicas must match one process on the global batch exactly)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(DIM, DIM)
        self.register_buffer("offset", torch.randn(DIM) * 0.1)  # rank-dependent init: broadcast from rank 0
        self.head = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.head(torch.tanh(self.trunk(x)) + self.offset)))


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = data(rank, step).to(next(model.parameters()).dtype)
    return model(x).pow(2).mean()


def reference_loss(reference: nn.Module, world_size: int, step: int) -> torch.Tensor:
    """The reference's loss: one process, every rank's rows in one batch."""
    rows = torch.cat([data(r, step) for r in range(world_size)])
    return reference(rows.to(next(reference.parameters()).dtype)).pow(2).mean()


def sgd_step(*modules: nn.Module, lr: float = 0.1) -> None:
    parity.sgd_step(*modules, lr=lr, skip_none=True)  # frozen and unused parameters stay


def assert_params_match(model: nn.Module, reference: nn.Module, where: str) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {name}: {m}")


def train(
    rank: int,
    world_size: int,
    steps: int,
    *,
    between: Callable[[int, nn.Module, nn.Module], None] = lambda step, model, reference: None,
    options: dict | None = None,
    build: Callable[[], nn.Module] = Net,
) -> nn.Module:
    """Trains ``build()`` replicated and as the reference; ``between(step, model, reference)``
    runs before each step's forward (freeze, swap, copy, ...). Checks grads every step."""
    model = seeded(build, 100 + rank)  # replicate() must broadcast rank 0's values
    reference = seeded(build, 100)
    replicate(model, **(options or {}))
    for step in range(steps):
        between(step, model, reference)
        loss_of(model, rank, step).backward()
        reference_loss(reference, world_size, step).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        sgd_step(model, reference)
    assert_params_match(model, reference, f"rank {rank} after {steps} steps")
    return model


# -- 1, 2: deep copies and pickles are plain, independent modules -----------------------


class CopyResult(NamedTuple):
    digest: str  # the trained replica, bitwise
    copy_class: str  # type(copy).__name__
    copy_hooks: int  # forward hooks left on the copy


def ema_copies(rank: int, world_size: int, when: str) -> CopyResult:
    """An EMA copy made before (or after) training; rank 0 alone runs it between steps."""
    holder: dict[str, nn.Module] = {}

    def between(step: int, model: nn.Module, reference: nn.Module) -> None:
        if (when == "before" and step == 0) or (when == "after" and step == 2):
            holder["ema"] = copy.deepcopy(model)
        ema = holder.get("ema")
        if ema is None:
            return
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
        if rank == 0:  # would hang or shift the collectives if the copy ran any
            ema.train()
            ema(data(rank, 99)).sum().backward()

    model = train(rank, world_size, 5, between=between)
    ema = holder["ema"]
    assert type(ema) is Net, f"rank {rank}: the copy is a {type(ema).__name__}"
    assert all(p.grad is None or rank == 0 for p in ema.parameters())
    hooks = len(ema._forward_pre_hooks) + len(ema._forward_hooks)
    return CopyResult(digest(model), type(ema).__name__, hooks)


@pytest.mark.parametrize("when", ["before", "after"])
def test_deepcopy_is_a_plain_independent_module(pools, when):
    results = pools.run(2, ema_copies, when)
    assert results[0].digest == results[1].digest, "replicas diverged"
    assert all(r.copy_class == "Net" and r.copy_hooks == 0 for r in results), results


def pickled(rank: int, world_size: int) -> str:
    def between(step: int, model: nn.Module, reference: nn.Module) -> None:
        if step == 2:
            restored = pickle.loads(pickle.dumps(model))
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            for other in (restored, loaded):
                assert type(other) is Net and not isinstance(other, ReplicateModule), type(other)
                assert not other._forward_pre_hooks and not other._forward_hooks
                for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
                    assert torch.equal(a, b), f"rank {rank}: {name} changed in the pickle"
                other(data(rank, 0)).sum().backward()  # usable, and runs no collective

    return digest(train(rank, world_size, 4, between=between))


def test_pickle_and_torch_save_give_a_plain_module(pools):
    digests = pools.run(2, pickled)
    assert digests[0] == digests[1]


# -- 3, 4: what is replicated changes during training ----------------------------------


def staged_unfreezing(rank: int, world_size: int, options: dict) -> str:
    def between(step: int, model: nn.Module, reference: nn.Module) -> None:
        for module in (model, reference):
            if step == 0:
                module.head.requires_grad_(False)
            elif step == 2:
                module.head.requires_grad_(True)  # unfreeze
            elif step == 4:
                module.trunk.weight.requires_grad_(False)  # freeze one tensor
            elif step == 5:
                module.trunk.weight.requires_grad_(True)

    def build() -> nn.Module:
        net = Net()
        net.head.requires_grad_(False)  # frozen at replicate(): still broadcast, as DDP does
        return net

    return digest(train(rank, world_size, 7, between=between, options=options, build=build))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("options", [{}, dict(TINY, gradient_as_bucket_view=False)], ids=["default", "tiny-copy"])
def test_staged_unfreezing(pools, world_size, options):
    assert len(set(pools.run(world_size, staged_unfreezing, options))) == 1


class _BoomOnce(torch.autograd.Function):
    """Identity forward; its backward raises once armed, midway through the model's backward."""

    armed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if _BoomOnce.armed:
            _BoomOnce.armed = False
            raise RuntimeError("boom in backward")
        return grad


def raised_backward(rank: int, world_size: int, options: dict, then: str) -> str:
    """A backward that raised on every rank (after the output layer's bucket left), then
    the next forward ("forward"; "replan": a layer frozen first) or the same backward again on
    the retained graph ("retry"), then training. The user does not zero the gradients: the
    failed step's partial ones are cleared with a warning ([Note: a backward that raised] in
    reducer.py), and every step after equals the reference."""

    def between(step: int, model: nn.Module, reference: nn.Module) -> None:
        if step != 2:
            return
        handle = model.head.register_forward_hook(lambda module, args, output: _BoomOnce.apply(output))
        loss = loss_of(model, rank, 50)
        handle.remove()
        _BoomOnce.armed = True
        with pytest.raises(RuntimeError, match="boom in backward"):
            loss.backward(retain_graph=True)
        if then == "retry":  # no forward between: the first hook finds the step's end gone
            with pytest.warns(UserWarning, match="raised before it ended"):
                loss.backward()
            reference_loss(reference, world_size, 50).backward()
            assert_grads_match(model, reference, f"rank {rank}: the retried backward")
            sgd_step(model, reference)
            return
        if then == "replan":
            for module in (model, reference):
                module.trunk.requires_grad_(False)
        with pytest.warns(UserWarning, match="raised before it ended"):
            loss_of(model, rank, 51)  # a forward with gradients ends the failed step

    return digest(train(rank, world_size, 5, between=between, options=options))


@pytest.mark.parametrize("then", ["forward", "replan", "retry"])
@pytest.mark.parametrize("options", [{}, dict(TINY, gradient_as_bucket_view=False)], ids=["default", "tiny-copy"])
def test_backward_that_raised_then_training(pools, options, then):
    assert len(set(pools.run(2, raised_backward, options, then))) == 1


def raised_on_one_rank(rank: int, world_size: int, options: dict, then: str) -> str:
    """A backward that raised on rank 1 only (after some buckets left), caught there, then a new
    forward or a retry on the retained graph; the others finished that step. Every rank raises, at
    the same collective, naming rank 1 and the step ([Note: a backward that raised] in reducer.py),
    instead of pairing rank 1's next buckets with the others' last; the group stays usable."""
    model = seeded(Net, 100 + rank)
    options = dict(options)
    hook = options.pop("comm_hook", False)
    # a retry is one backward more than the others run: it pairs with their next backward only where
    # the forward runs no collective of its own (the buffer broadcast), as under DDP
    replicate(model, **options, broadcast_buffers=then != "retry")
    if hook:  # the hook path shadows from the first bucket not launched too
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    error = "no error"
    try:
        for step in range(5):
            if step == 2 and rank == 1:
                handle = model.head.register_forward_hook(lambda module, args, output: _BoomOnce.apply(output))
                loss = loss_of(model, rank, step)
                handle.remove()
                _BoomOnce.armed = True
                with pytest.raises(RuntimeError, match="boom in backward"):
                    loss.backward(retain_graph=True)
                with pytest.warns(UserWarning, match="raised before it ended"):
                    loss.backward() if then == "retry" else loss_of(model, rank, step).backward()
            else:
                loss_of(model, rank, step).backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as raised:
        error = str(raised)
    assert error.startswith(f"replicate(): rank {rank}: synchronised step 2 raised on rank 1 "), error
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    assert total.item() == world_size, f"rank {rank}: the group is not usable after the error"
    return error.split(":", 2)[2]


@pytest.mark.parametrize("then", ["forward", "retry"])
@pytest.mark.parametrize(
    "options",
    [{}, dict(TINY, graph="dynamic"), dict(TINY, gradient_as_bucket_view=False), dict(TINY, comm_hook=True)],
    ids=["default", "tiny-dynamic", "tiny-copy", "tiny-hook"],
)
def test_backward_that_raised_on_one_rank_raises_on_every_rank(pools, options, then):
    assert len(set(pools.run(3, raised_on_one_rank, options, then))) == 1


def surgery(rank: int, world_size: int, options: dict) -> str:
    def between(step: int, model: nn.Module, reference: nn.Module) -> None:
        if step == 2:  # a new head, initialised differently on every rank: rank 0's wins
            torch.manual_seed(500 + rank)
            model.head = nn.Linear(DIM, DIM)
            torch.manual_seed(500)
            reference.head = nn.Linear(DIM, DIM)
        elif step == 4:  # a new parameter
            for module, seed in ((model, rank), (reference, 0)):
                module.register_parameter("scale", nn.Parameter(torch.full((DIM,), 1.0 + seed)))
                module.forward = _scaled_forward(module)
        elif step == 5:  # a layer swapped for one of another shape
            for module, seed in ((model, rank), (reference, 0)):
                torch.manual_seed(700 + seed)
                module.out = nn.Linear(DIM, 3)

    return digest(train(rank, world_size, 7, between=between, options=options))


def _scaled_forward(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    plain = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return plain(module, x * module.scale)

    return forward


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("options", [{}, TINY], ids=["default", "tiny"])
def test_model_surgery_after_training_started(pools, world_size, options):
    assert len(set(pools.run(world_size, surgery, options))) == 1


def converted(rank: int, world_size: int) -> str:
    def between(step: int, model: nn.Module, reference: nn.Module) -> None:
        if step == 2:
            model.double()
            reference.double()

    model = train(rank, world_size, 4, between=between, build=_plain_mlp)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    return digest(model)


def _plain_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))


def test_dtype_change_after_replicate_re_plans(pools):
    assert len(set(pools.run(2, converted))) == 1


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, 2)
        self.b = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x.to(self.b.weight.dtype)).float()


def submodule_converted(rank: int, world_size: int) -> str:
    model = replicate(seeded(TwoBranches, 0))
    model(data(rank, 0)).sum().backward()
    model.b.double()  # a submodule, not the replicated root: not seen until its gradient arrives
    try:
        model(data(rank, 1)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_submodule_conversion_is_refused_naming_the_fix(pools):
    for message in pools.run(2, submodule_converted):
        assert "replicate(): parameter 'b." in message and "changed since it was planned" in message, message
        assert "float64" in message and "Convert the whole replicated model" in message, message


# -- 5: optimizer in backward, and hooks that would see the local gradient -----------


def optimizer_in_backward(rank: int, world_size: int, when: str, options: dict) -> str:
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = seeded(Net, 100 + rank)
    reference = seeded(Net, 100)
    if when == "before":
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1, "momentum": 0.9})
    replicate(model, **options)
    if when == "after":
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1, "momentum": 0.9})
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        with model.no_sync():  # accumulated: stepped once, on the average of both micro-batches
            loss_of(model, rank, 10 + step).backward()
        loss_of(model, rank, step).backward()
        assert all(p.grad is None for p in model.parameters()), f"rank {rank} step {step}: grads not consumed"
        (reference_loss(reference, world_size, 10 + step) + reference_loss(reference, world_size, step)).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        assert_params_match(model, reference, f"rank {rank} step {step}")
    return digest(model)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("options", [{}, dict(TINY, gradient_as_bucket_view=False)], ids=["default", "tiny-copy"])
def test_optimizer_in_backward_steps_once_on_the_average(pools, when, options):
    assert len(set(pools.run(2, optimizer_in_backward, when, options))) == 1


def foreign_hook(rank: int, world_size: int) -> str:
    model = seeded(Net, 0)
    model.head.weight.register_post_accumulate_grad_hook(lambda p: None)
    try:
        replicate(model)
    except ValueError as error:
        return str(error)
    return "no error"


def foreign_hook_after(rank: int, world_size: int, options: dict) -> str:
    # Registered after replicate(): it would find .grad moved into its bucket (None), so an
    # optimizer stepped there would silently never step. Refused at the next backward.
    model = replicate(seeded(Net, 0), **options)
    model(data(rank, 0)).pow(2).mean().backward()
    model.head.weight.register_post_accumulate_grad_hook(lambda p: None)
    try:
        model(data(rank, 1)).pow(2).mean().backward()
    except ValueError as error:
        return str(error)
    return "no error"


def test_post_accumulate_grad_hook_is_refused_on_every_rank(pools):
    for message in pools.run(2, foreign_hook):
        assert "parameter 'head.weight' has a post-accumulate-grad hook" in message, message
        assert "_apply_optimizer_in_backward" in message, message


@pytest.mark.parametrize("options", [{}, dict(TINY, gradient_as_bucket_view=False)], ids=["default", "tiny-copy"])
def test_post_accumulate_grad_hook_added_later_is_refused_on_every_rank(pools, options):
    for message in pools.run(2, foreign_hook_after, options):
        assert "parameter 'head.weight' has a post-accumulate-grad hook" in message, message
        assert "_apply_optimizer_in_backward" in message, message


# -- 6, 7: create_graph, undefined gradients -------------------------------------------


def create_graph(rank: int, world_size: int, options: dict) -> str:
    def backward(loss: torch.Tensor) -> None:
        loss.backward(create_graph=True)

    model = seeded(Net, 100 + rank)
    reference = seeded(Net, 100)
    replicate(model, **options)
    with pytest.warns(UserWarning, match="create_graph=True"):
        for step in range(3):
            backward(loss_of(model, rank, step))
            backward(reference_loss(reference, world_size, step))
            assert_grads_match(model, reference, f"rank {rank} step {step}")
            sgd_step(model, reference)
    return digest(model)


@pytest.mark.parametrize("options", [{}, dict(TINY, gradient_as_bucket_view=False)], ids=["default", "tiny-copy"])
def test_backward_with_create_graph(pools, options):
    assert len(set(pools.run(2, create_graph, options))) == 1


class ScaleBy(torch.autograd.Function):
    """x * w, but gives w no gradient (returns None for it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * 2, None


class Undefined(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.ones(DIM))  # its gradient is never defined
        self.unused = nn.Linear(DIM, DIM)  # its output never reaches the loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.unused(x)
        return ScaleBy.apply(self.lin(x), self.gain)


def undefined_grads(rank: int, world_size: int) -> str:
    # train() checks every step that a .grad the reference leaves None (gain,
    # unused.*) is None here too, and that the others match
    return digest(train(rank, world_size, 3, build=Undefined))


def test_undefined_gradients_stay_none(pools):
    assert len(set(pools.run(2, undefined_grads))) == 1


# -- 8, 9: compiled models with buffers; evaluation on one rank ------------------------


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.out = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.lin(x))))


def compiled_with_buffers(rank: int, world_size: int, backend: str) -> str:
    """BatchNorm buffers broadcast every forward, under torch.compile.

    Batch statistics are per rank (as DDP's), so the one-process reference
    runs BatchNorm in training mode on each rank's shard and averages the
    losses; the eager replica is the compiled one's twin (same data, no
    compile): its buffers must agree too.
    """
    torch._dynamo.reset()
    eager = replicate(seeded(Normed, 100 + rank))
    compiled_model = replicate(seeded(Normed, 100 + rank))
    reference = seeded(Normed, 100)  # rank 0's, which replicate() broadcast
    compiled = torch.compile(compiled_model, backend=backend)
    for step in range(3):
        x = data(rank, step) + rank
        compiled(x).pow(2).mean().backward()
        eager(x).pow(2).mean().backward()
        (sum(reference(data(r, step) + r).pow(2).mean() for r in range(world_size)) / world_size).backward()
        named = zip(compiled_model.named_parameters(), eager.parameters(), reference.parameters(), strict=True)
        for (name, p), q, ref in named:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
            torch.testing.assert_close(
                p.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name} vs one process: {m}"
            )
        sgd_step(compiled_model, eager, reference)
    for name in ("running_mean", "running_var"):
        a, b = getattr(compiled_model.norm, name), getattr(eager.norm, name)
        torch.testing.assert_close(a, b, msg=lambda m: f"rank {rank} {name}: {m}")
    return digest(compiled_model)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_torch_compile_with_batchnorm(pools, backend):
    assert len(set(pools.run(2, compiled_with_buffers, backend, timeout_s=240))) == 1


def eval_on_one_rank(rank: int, world_size: int) -> str:
    def between(step: int, model: nn.Module, reference: nn.Module) -> None:
        if rank == 0:  # validation, sampling, checkpoint checks: rank 0 alone
            with torch.no_grad():
                model(data(0, 50 + step))
            with torch.inference_mode():
                model.eval()
                model(data(0, 60 + step))
                model.train()

    return digest(train(rank, world_size, 4, between=between))


def test_no_grad_forward_on_one_rank_runs_no_collective(pools):
    # A collective in rank 0's extra forwards would wait for rank 1 (the
    # harness times out) or shift every later collective (parity fails).
    assert len(set(pools.run(2, eval_on_one_rank, timeout_s=60))) == 1


# -- 10: sparse gradients --------------------------------------------------------------


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, DIM, sparse=True)
        self.rare = nn.Embedding(20, DIM, sparse=True)  # used by one rank, or none
        self.out = nn.Linear(DIM, 2)

    def forward(self, tokens: torch.Tensor, use_rare: bool) -> torch.Tensor:
        h = self.embed(tokens).mean(1)
        if use_rare:
            h = h + self.rare(tokens).mean(1)
        return self.out(h)


def tokens(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 20, (3, 4), generator=torch.Generator().manual_seed(100 * step + rank))


def sparse_embeddings(rank: int, world_size: int, options: dict) -> str:
    model = seeded(Bag, 100 + rank)
    reference = seeded(Bag, 100)
    replicate(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(4):

        def use_rare(r: int) -> bool:
            return step % 2 == 0 and r == world_size - 1  # one rank at even steps, none at odd

        model(tokens(rank, step), use_rare(rank)).pow(2).mean().backward()
        total = sum(reference(tokens(r, step), use_rare(r)).pow(2).mean() for r in range(world_size))
        (total / world_size).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            where = f"rank {rank} step {step} {name}"
            if q.grad is None:
                assert p.grad is None, f"{where}: a parameter no rank used got a gradient"
                continue
            assert p.grad is not None, f"{where}: no gradient"
            assert p.grad.is_sparse == q.grad.is_sparse, f"{where}: sparse {p.grad.is_sparse} vs {q.grad.is_sparse}"
            torch.testing.assert_close(
                p.grad.to_dense(), q.grad.to_dense(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}"
            )
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    return digest(model)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("options", [{}, dict(TINY, gradient_as_bucket_view=False)], ids=["default", "tiny-copy"])
def test_sparse_embeddings(pools, world_size, options):
    assert len(set(pools.run(world_size, sparse_embeddings, options))) == 1


def sparse_flag_flipped(rank: int, world_size: int, to_sparse: bool) -> str:
    # The flag decides the plan (dense bucket slot or sparse all-reduce); flipping it after
    # replicate() is refused at the next backward, naming the parameter and the fix.
    model = seeded(Bag, 100)
    model.embed.sparse = not to_sparse
    replicate(model)
    model(tokens(rank, 0), False).pow(2).mean().backward()
    model.zero_grad()  # .grad None: the next gradient arrives as the flag now says
    model.embed.sparse = to_sparse
    try:
        model(tokens(rank, 1), False).pow(2).mean().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("to_sparse", [True, False], ids=["dense-to-sparse", "sparse-to-dense"])
def test_sparse_flag_flipped_after_replicate_is_refused_on_every_rank(pools, to_sparse):
    for message in pools.run(2, sparse_flag_flipped, to_sparse):
        assert "parameter 'embed.weight' was planned for" in message, message
        assert "sparse flag" in message and "before replicate()" in message, message


# -- 11: fully_shard on an enclosing module after replicate(): exact, tests/test_nested.py ---


# -- 13: bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, error, words",
    [
        (
            {"bucket_cap_mb": float("inf")},
            ValueError,
            ["bucket_cap_mb must be a positive number of MiB, got inf", "finite"],
        ),
        ({"first_bucket_cap_mb": float("nan")}, ValueError, ["first_bucket_cap_mb", "got nan"]),
        ({"gradient_divide_factor": float("inf")}, ValueError, ["gradient_divide_factor", "got inf", "finite"]),
        (
            {"ignored_modules": nn.Linear(2, 2)},
            TypeError,
            ["ignored_modules must be an iterable of modules, got a single Linear", "ignored_modules=[model.head]"],
        ),
        ({"ignored_modules": 5}, TypeError, ["ignored_modules must be an iterable of modules, got int"]),
        ({"device_id": -1}, ValueError, ["device_id must be a non-negative accelerator index, got -1", "LOCAL_RANK"]),
    ],
)
def test_bad_input_names_option_value_and_fix(options, error, words):
    with pytest.raises(error) as info:
        replicate(MLP(), **options)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_device_mesh_as_process_group_suggests_get_group():
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.__new__(DeviceMesh)  # the type is what matters; no process group needed
    hint = r"got a DeviceMesh; pass mesh=mesh \(1-D\) or process_group=mesh.get_group\(\)"
    with pytest.raises(TypeError, match=hint):
        replicate(MLP(), process_group=mesh)


# -- property: freezes, unfreezes, swaps and deep copies interleaved at random --------

NUM_LAYERS = 4
ACTIONS = st.lists(
    st.tuples(st.sampled_from(["none", "freeze", "unfreeze", "swap", "copy"]), st.integers(0, NUM_LAYERS - 1)),
    min_size=1,
    max_size=6,
)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(NUM_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def random_changes(rank: int, world_size: int, actions: list[tuple[str, int]], options: dict) -> str:
    copies: list[nn.Module] = []

    def between(step: int, model: nn.Module, reference: nn.Module) -> None:
        action, index = actions[step]
        trainable = [i for i, layer in enumerate(model.layers) if layer.weight.requires_grad]
        if action == "freeze" and trainable == [index]:
            action = "none"  # keep something to train: a backward needs a parameter
        for module, seed in ((model, rank), (reference, 0)):
            layer = module.layers[index]
            if action == "freeze":
                layer.requires_grad_(False)
            elif action == "unfreeze":
                layer.requires_grad_(True)
            elif action == "swap":  # rank-dependent init: rank 0's must win
                torch.manual_seed(10 * step + seed)
                module.layers[index] = nn.Linear(DIM, DIM)
        if action == "copy":
            copies.append(copy.deepcopy(model))
            copies[-1](data(rank, 77)).sum().backward()  # a copy runs alone, without collectives

    model = train(rank, world_size, len(actions), between=between, options=options, build=Stack)
    assert all(type(c) is Stack for c in copies)
    return digest(model)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS, options=st.sampled_from([{}, dict(TINY, gradient_as_bucket_view=False)]))
def test_random_changes_between_steps(pools, actions, options):
    assert len(set(pools.run(2, random_changes, actions, options))) == 1


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
def test_random_changes_between_steps_three_ranks(pools, actions):
    assert len(set(pools.run(3, random_changes, actions, TINY))) == 1
