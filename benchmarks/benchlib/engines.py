"""``Engine``: one model copy, wrapped one way, with its own optimizer.

Every engine of a benchmark lives in the same process group on its own copy
of the model (same init) and steps with ``SGD(lr=1e-4)``: forward, backward,
``optimizer.step()``, ``zero_grad(set_to_none=True)``. ``build_engine``
makes the kinds of ``bench_ddp.py``; the other scripts wrap their modules
themselves and hand them to ``Engine``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchlib.models import build_model, loss_of
from torchreplicate import ReplicateModule, replicate
from torchreplicate.reducer.reducer import Reducer

# What build_engine makes:
# - local: the bare model, no communication;
# - ddp / ddp_gbv: torch DDP defaults / with gradient_as_bucket_view=True;
# - ours: replicate() defaults (reproducible: DDP's 25 MiB cap, nothing timed);
# - ours_tuned: replicate(bucket_layout="tuned"): cap, bucket ends and the tied
#   split chosen from timings of the first step (the opt-in; not reproducible);
# - torch_replicate: torch's own FSDP2-based replicate
#   (torch/distributed/_composable/replicate_with_fsdp.py), on each transformer
#   block and then the root, as FSDP2's recipes apply it (a flat model: the root);
# - reducer: replicate(), plus the reducer it builds at world size 2 (at world
#   size 1 it builds none): its bookkeeping when collectives are nearly free;
# - noop_hooks: one empty Python post-accumulate-grad hook per parameter, the
#   floor of any reducer driven by Python hooks;
ENGINE_KINDS = (
    "local",
    "ddp",
    "ddp_gbv",
    "ours",
    "ours_tuned",
    "torch_replicate",
    "reducer",
    "noop_hooks",
)


class Engine:
    """One model copy, wrapped one way, with its own SGD.

    Args:
        kind: a name for reports.
        model_name: which benchmark model (selects the loss).
        module: what ``step`` calls: the wrapped model.
        raw: the bare model inside ``module`` (for parameter comparisons).
        keep: objects that must live as long as the engine (hook handles, states).
        reducer: a reducer the state does not hold (the ``reducer`` kind);
            others are found through ``replicate.state``.
    """

    def __init__(
        self,
        kind: str,
        model_name: str,
        module: nn.Module,
        raw: nn.Module,
        *,
        keep: Sequence[Any] = (),
        reducer: Optional[Reducer] = None,
    ) -> None:
        self.kind = kind
        self.model_name = model_name
        self.module = module
        self.raw = raw
        self.keep = list(keep)  # alive as long as the engine
        self._reducer = reducer  # only the ``reducer`` kind
        self.opt = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """One training step: forward, backward, optimizer step, grads to None."""
        x, y = batch
        loss = loss_of(self.model_name, self.module(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    @property
    def reducer(self) -> Optional[Reducer]:
        """Our reducer in this engine, if any (None for DDP, local, or ``replicate()`` at world size 1)."""
        if self._reducer is not None:
            return self._reducer
        if isinstance(self.module, ReplicateModule):
            return replicate.state(self.module).reducer
        return None

    @property
    def num_params(self) -> int:
        """Elements in the model's parameters."""
        return sum(p.numel() for p in self.raw.parameters())

    @property
    def num_tensors(self) -> int:
        """Parameter tensors of the model."""
        return len(list(self.raw.parameters()))


def build_engine(kind: str, model_name: str, *, seed: int = 0, model: Optional[nn.Module] = None) -> Engine:
    """An engine of one of ``ENGINE_KINDS`` around a fresh model (or ``model``).

    Args:
        kind: one of ``ENGINE_KINDS``.
        model_name: one of ``benchlib.models.MODEL_NAMES``.
        seed: seeds the model's init when ``model`` is None. Default 0.
        model: a model built by the caller (the memory phase builds it before
            its baseline). Default: a fresh one.
    """
    if model is None:
        torch.manual_seed(seed)
        model = build_model(model_name)
    if kind == "local":
        return Engine(kind, model_name, model, model)
    if kind in ("ddp", "ddp_gbv"):
        return Engine(kind, model_name, DDP(model, gradient_as_bucket_view=kind == "ddp_gbv"), model)
    if kind == "ours":
        return Engine(kind, model_name, replicate(model), model)
    if kind == "ours_tuned":
        return Engine(kind, model_name, replicate(model, bucket_layout="tuned"), model)
    if kind == "torch_replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

        for child in _blocks(model):
            torch_replicate(child)
        return Engine(kind, model_name, torch_replicate(model), model)
    if kind == "reducer":
        replicated = replicate(model)
        return Engine(kind, model_name, replicated, model, reducer=build_internal_reducer(replicated))
    if kind == "noop_hooks":

        def noop(param: torch.Tensor) -> None:
            return None

        handles = [p.register_post_accumulate_grad_hook(noop) for p in model.parameters()]
        return Engine(kind, model_name, model, model, keep=handles)
    raise ValueError(f"build_engine(): unknown kind {kind!r}; expected one of {ENGINE_KINDS}")


def _blocks(model: nn.Module) -> list[nn.Module]:
    # The units FSDP2's recipes wrap (a transformer's blocks): the children of the model's largest
    # container of parameters below the root; none for a flat model (the root alone, one all-reduce).
    containers = [
        m for m in model.modules() if m is not model and isinstance(m, (nn.Sequential, nn.ModuleList)) and len(m) > 1
    ]
    if not containers:
        return []
    biggest = max(containers, key=lambda m: sum(p.numel() for p in m.parameters()))
    return [child for child in biggest if any(True for _ in child.parameters())]


def build_internal_reducer(replicated: nn.Module) -> Reducer:
    """Our reducer for a module ``replicate()`` wrapped at world size 1, where it builds none.

    Made by the state's own ``make_reducer``, so it gets
    exactly the options and collaborators ``replicate()`` gives a reducer at
    world size 2, whatever the constructor takes. The state does not hold it,
    so ``replicate()``'s forward hooks behave as in the ``ours`` engine; the
    reducer's gradient hooks queue the end of backward themselves.
    """
    state = replicate.state(replicated)
    assert state.reducer is None, "replicate() builds no reducer at world size 1"
    state.make_reducer()
    reducer, state.reducer = state.reducer, None  # the engine holds it, not the state
    assert reducer is not None
    return reducer
