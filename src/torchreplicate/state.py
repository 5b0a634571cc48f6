"""Per-module state of a replicated module: set-up and forward hooks.

``ReplicateState`` decides which parameters and buffers are replicated,
checks them across ranks, broadcasts rank 0's values, builds the reducer and
installs the forward hooks. Gradient reduction itself is in reducer.py.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.collectives import WeakGroup, broadcast_coalesced, verify_params_across_ranks
from torchreplicate.config import ReplicateConfig
from torchreplicate.grad_layout import grad_layout
from torchreplicate.profiling import labelled
from torchreplicate.reducer import Learned, Reducer, SyncSwitch
from torchreplicate.reduction import AllReduce, HookReduction, Reduction

MiB = 1024 * 1024


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether PyTorch's ``fully_shard`` (FSDP2) manages ``module``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


class ReplicateState:
    """What ``replicate()`` keeps for one module; ``replicate.state(module)``.

    Args:
        module: the root module ``replicate()`` was applied to.
        config: its validated options.
        process_group: the group to average over; None: the world group.
    """

    def __init__(
        self, module: nn.Module, config: ReplicateConfig, process_group: Optional[dist.ProcessGroup] = None
    ) -> None:
        # The registry maps module -> state weakly; a strong reference back
        # would keep every replicated model (and its process group) alive
        # until interpreter exit.
        self._module_ref = weakref.ref(module)  # the replicated root
        self.config = config  # options, frozen
        self._given_group = None if process_group is None else WeakGroup(process_group)
        self._group: Optional[WeakGroup] = None  # resolved at init, held weakly
        self.params: list[nn.Parameter] = []  # replicated parameters, registration order
        self._param_names: list[str] = []  # their fully qualified names
        # (owner, name) of replicated buffers; owners held weakly, as the root
        # is often one of them (see _module_ref).
        self._buffers: list[tuple[weakref.ref[nn.Module], str]] = []
        # How gradients are reduced: from the options, or a registered comm
        # hook. Kept here, so every reducer built for the module (also after a
        # re-plan) uses the same one.
        self.reduction: Reduction = AllReduce(config.reduce_dtype, config.gradient_divide_factor)
        self.sync = SyncSwitch()  # set_requires_gradient_sync(), read by the reducer at backward
        self.reducer: Optional[Reducer] = None  # None when there is nothing to reduce
        self._checked_at_forward = False  # first forward re-checked the parameters
        self._num_forwards = 0  # forwards of the root so far
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True),
            module.register_forward_hook(self._post_forward),
            module.register_load_state_dict_post_hook(self._after_load_state_dict),
        ]

    # -- public --------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The root module ``replicate()`` was applied to."""
        module = self._module_ref()
        if module is None:
            raise RuntimeError("replicate.state(): the replicated module was garbage-collected")
        return module

    @property
    def param_names(self) -> tuple[str, ...]:
        """Fully qualified names of the replicated parameters, as in ``named_parameters()``."""
        return tuple(self._param_names)

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group gradients are averaged over."""
        if self._group is None:
            raise RuntimeError("replicate.state(): the module was not initialised")
        return self._group.get()

    @property
    def world_size(self) -> int:
        """Number of ranks in the process group."""
        return dist.get_world_size(self.group)

    @property
    def requires_gradient_sync(self) -> bool:
        """Whether backwards average gradients (``set_requires_gradient_sync``)."""
        return self.sync.on

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """See ``ReplicateModule.set_requires_gradient_sync``."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                f"set_requires_gradient_sync(): expected a bool, got {type(requires_gradient_sync).__name__}"
            )
        self.sync.on = requires_gradient_sync

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """See ``ReplicateModule.register_comm_hook``."""
        reduction = HookReduction(state, hook)  # checks the hook's signature
        for option in ("reduce_dtype", "gradient_divide_factor"):
            value = getattr(self.config, option)
            if value is not None:
                raise ValueError(
                    f"register_comm_hook(): replicate({option}={value}) and a comm hook both decide "
                    f"how gradients are reduced; drop {option} (the hook owns the wire format and "
                    "the averaging, e.g. bf16_compress_hook)"
                )
        if isinstance(self.reduction, HookReduction):
            raise RuntimeError(
                "register_comm_hook(): a comm hook is already registered; it can be registered only once"
            )
        if not self.params:
            raise RuntimeError(
                "register_comm_hook(): this module has no replicated parameters "
                "(all ignored, frozen or managed by fully_shard)"
            )
        if self.reducer is None:
            # World size 1 runs no reducer until a hook asks for one; it cannot
            # have counted backwards, so forwards stand in for them.
            if self._num_forwards:
                raise RuntimeError(
                    f"register_comm_hook(): training already ran {self._num_forwards} forward(s); "
                    "register the hook before the first backward (at world size 1: before the "
                    "first forward)"
                )
            self.reduction = reduction
            self.reducer = self._build_reducer()
        else:
            self.reducer.use_reduction(reduction)
            self.reduction = reduction

    def remove_hooks(self) -> None:
        """Removes every hook ``replicate()`` installed (forward and gradient)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.reducer is not None:
            self.reducer.remove_hooks()
            self.reducer = None

    # -- set-up ----------------------------------------------------------------

    def init(self) -> None:
        """Collects, checks and broadcasts parameters; builds the reducer.

        Runs at ``replicate()`` and again at the first forward if the set of
        replicated parameters changed in between (``fully_shard`` applied to a
        child after ``replicate`` on the root).
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "replicate(): torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first (torchrun or "
                "torchreplicate.launcher set up its environment)"
            )
        world = dist.group.WORLD
        assert world is not None, "initialised above"
        self._group = self._given_group or WeakGroup(world)
        if self.config.device_id is not None:
            self.module.to(self.config.device_id)
        learned: Optional[Learned] = None
        if self.reducer is not None:  # a re-plan keeps what the reducer learned
            learned = self.reducer.learned
            self.reducer.remove_hooks()
            self.reducer = None
        names, params = self._collect_params()
        self.params, self._param_names = params, names
        self._buffers = list(self._collect_buffers())
        device = self._collective_device()
        verify_params_across_ranks(names, params, self.group, device)
        if self.world_size > 1:
            broadcast_coalesced([p.detach() for p in params] + self._buffer_values(), self.group)
        if params and (self.world_size > 1 or isinstance(self.reduction, HookReduction)):
            self.reducer = self._build_reducer(learned)

    def _build_reducer(self, learned: Optional[Learned] = None) -> Reducer:
        return Reducer(
            self.params,
            self._param_names,
            self.group,
            bucket_cap_bytes=int(self.config.bucket_cap_mb * MiB),
            first_bucket_cap_bytes=int(self.config.first_bucket_cap_mb * MiB),
            layout=grad_layout(self.config.gradient_as_bucket_view),
            reduction=self.reduction,
            sync=self.sync,
            learned=learned,
        )

    def _skipped_modules(self) -> list[nn.Module]:
        skipped = list(self.config.ignored_modules)
        skipped += [m for m in self.module.modules() if m is not self.module and is_fully_sharded(m)]
        return skipped

    def _collect_params(self) -> tuple[list[str], list[nn.Parameter]]:
        skipped_ids = {id(p) for m in self._skipped_modules() for p in m.parameters()}
        names, params = [], []
        for name, param in self.module.named_parameters():
            if id(param) in skipped_ids or not param.requires_grad:
                continue
            names.append(name)
            params.append(param)
        return names, params

    def _collect_buffers(self) -> Iterator[tuple[weakref.ref[nn.Module], str]]:
        skipped_ids = {id(b) for m in self._skipped_modules() for b in m.buffers()}
        seen: set[int] = set()
        for module in self.module.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is None or id(buffer) in skipped_ids or id(buffer) in seen:
                    continue
                seen.add(id(buffer))
                yield weakref.ref(module), name

    def _buffer_values(self) -> list[torch.Tensor]:
        return [getattr(owner(), name) for owner, name in self._buffers]

    def _collective_device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        for tensor in list(self.params) + self._buffer_values():
            return tensor.device
        return torch.device("cpu")

    # -- forward hooks -------------------------------------------------------

    @labelled("pre_forward")
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._num_forwards += 1
        if not self._checked_at_forward:
            self._checked_at_forward = True
            current = [id(p) for p in self._collect_params()[1]]
            if current != [id(p) for p in self.params]:
                self.init()
        if self.config.broadcast_buffers and self._buffers and self.world_size > 1:
            self._broadcast_buffers()

    def _after_load_state_dict(self, module: nn.Module, incompatible_keys: Any) -> None:
        # load_state_dict(assign=True) swaps in new Parameter objects, which
        # carry none of the reducer's hooks: re-check at the next forward.
        self._checked_at_forward = False

    def _broadcast_buffers(self) -> None:
        # Out of place: a graph from an earlier forward may have saved the old
        # tensors (two forwards through BatchNorm before one backward).
        fresh = broadcast_coalesced(self._buffer_values(), self.group, in_place=False)
        for (owner, name), tensor in zip(self._buffers, fresh, strict=True):
            setattr(owner(), name, tensor)

    @labelled("post_forward")
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        reducer = self.reducer
        if reducer is None or not torch.is_grad_enabled():
            return output
        for tensor in _tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(_OutputGradHook(reducer))
        return output


class _OutputGradHook:
    # Queues the reducer's end-of-backward work from the outermost backward
    # pass ([Note: end of backward] in reducer.py).
    __slots__ = ("reducer",)

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer

    def __call__(self, grad: torch.Tensor) -> None:
        self.reducer.queue_finalize()


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


def warn_no_effect(option: str, value: Any, why: str) -> None:
    """Warns that a DDP option is accepted for compatibility but changes nothing."""
    warnings.warn(f"replicate(): {option}={value!r} has no effect: {why}", UserWarning, stacklevel=3)
