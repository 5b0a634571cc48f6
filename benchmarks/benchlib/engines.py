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
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchlib.models import build_model, loss_of
from benchlib.report import MiB
from torchreplicate import ReplicateConfig, ReplicateModule, replicate
from torchreplicate.reducer import Reducer

# What build_engine makes:
# - local: the bare model, no communication;
# - ddp / ddp_gbv: torch DDP defaults / with gradient_as_bucket_view=True;
# - ours: replicate() defaults;
# - reducer: our Reducer built directly on the group (world size 1, where
#   replicate() builds none): its bookkeeping when collectives are nearly free;
# - noop_hooks: one empty Python post-accumulate-grad hook per parameter, the
#   floor of any reducer driven by Python hooks.
ENGINE_KINDS = ("local", "ddp", "ddp_gbv", "ours", "reducer", "noop_hooks")


class Engine:
    """One model copy, wrapped one way, with its own SGD.

    Args:
        kind: a name for reports.
        model_name: which benchmark model (selects the loss).
        module: what ``step`` calls: the wrapped model.
        raw: the bare model inside ``module`` (for parameter comparisons).
        keep: objects that must live as long as the engine (hook handles, states).
        reducer: a reducer built directly (the ``reducer`` kind); others are
            found through ``replicate.state``.
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
    if kind == "reducer":
        return Engine(kind, model_name, model, model, reducer=build_internal_reducer(model))
    if kind == "noop_hooks":

        def noop(param: torch.Tensor) -> None:
            return None

        handles = [p.register_post_accumulate_grad_hook(noop) for p in model.parameters()]
        return Engine(kind, model_name, model, model, keep=handles)
    raise ValueError(f"build_engine(): unknown kind {kind!r}; expected one of {ENGINE_KINDS}")


def build_internal_reducer(model: nn.Module) -> Reducer:
    """Our ``Reducer`` on the world group with ``replicate()``'s default options.

    The one place the benchmarks call the library's internal constructor:
    ``replicate()`` builds no reducer at world size 1, and this engine exists
    to measure the reducer's bookkeeping when collectives are nearly free.
    Mirrors ``ReplicateState._build_reducer`` (src/torchreplicate/state.py)
    as of the Reducer refactor (layout=, reduction=, sync=); update both
    together.
    """
    from torchreplicate.grad_layout import grad_layout
    from torchreplicate.reducer import SyncSwitch
    from torchreplicate.reduction import AllReduce

    config = ReplicateConfig()  # replicate()'s defaults
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    world = dist.group.WORLD
    assert world is not None, "init_process_group() first"
    return Reducer(
        [p for _, p in named],
        [n for n, _ in named],
        world,
        bucket_cap_bytes=int(config.bucket_cap_mb * MiB),
        first_bucket_cap_bytes=int(config.first_bucket_cap_mb * MiB),
        layout=grad_layout(config.gradient_as_bucket_view),
        reduction=AllReduce(config.reduce_dtype, config.gradient_divide_factor),
        sync=SyncSwitch(),
    )
