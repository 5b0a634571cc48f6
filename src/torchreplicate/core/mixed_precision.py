"""Mixed precision with torch's ``MixedPrecisionPolicy``: low-precision compute, fp32 master weights.

``replicate(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))``
keeps the parameters, their ``.grad``, the buckets and the optimizer in
their own dtype (fp32), and computes in ``param_dtype``: every module that
owns replicated parameters casts them in a forward pre-hook (a
differentiable ``p.to(param_dtype)``, put in the module's ``_parameters``
for the forward only) and puts the parameters back in a forward hook that
always runs. The gradient flows back through the cast, so the parameters'
post-accumulate-grad hooks (the reducer's) fire as usual, with fp32
gradients. Per module, not once at the root: a checkpointed block recomputes
its forward in backward, after the root's forward ended, and re-runs its own
hooks then. As in FSDP2, the gradients travel in ``reduce_dtype``, by
default ``param_dtype``; floating inputs of the root are cast to
``param_dtype`` (``cast_forward_inputs``) and its floating outputs to
``output_dtype`` when set; buffers are not cast.

Limits: a parameter used outside its module's ``__call__`` (read directly
by another module, or in a method other than ``forward``) is not cast.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchreplicate.config import policy_dtypes
from torchreplicate.core.plan import Plan
from torchreplicate.torch_internals import parameters_of


class MixedPrecision:
    """The hooks of one replicated module's mixed precision; re-installed at every re-plan.

    Args:
        policy: the ``MixedPrecisionPolicy``.
    """

    def __init__(self, policy: Any) -> None:
        # - Configuration
        self.param_dtype, _ = policy_dtypes(policy)
        self.output_dtype: Optional[torch.dtype] = policy.output_dtype
        self.cast_inputs = bool(policy.cast_forward_inputs) and self.param_dtype is not None
        # - Hooks on the modules that own parameters, for the current plan
        self._handles: list[RemovableHandle] = []

    def install(self, root: nn.Module, plan: Plan) -> None:
        """Hooks every module owning a floating candidate parameter of ``plan``."""
        self.remove()
        if self.param_dtype is None:
            return
        wanted = {id(p) for p in plan.candidates if p.is_floating_point() and p.dtype != self.param_dtype}
        for module in root.modules():
            if names := [name for name, p in module.named_parameters(recurse=False) if id(p) in wanted]:
                cast = _CastParams(names, self.param_dtype)
                self._handles.append(module.register_forward_pre_hook(cast.before))
                self._handles.append(module.register_forward_hook(cast.after, always_call=True))

    def remove(self) -> None:
        """Removes every hook it installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def cast_inputs_of(self, args: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
        """The root's inputs in ``param_dtype`` (None: unchanged)."""
        if not self.cast_inputs:
            return None
        assert self.param_dtype is not None
        return tuple(_cast_floating(arg, self.param_dtype) for arg in args)

    def cast_output(self, output: Any) -> Any:
        """The root's output in ``output_dtype`` (unchanged when it is None)."""
        return output if self.output_dtype is None else _cast_floating(output, self.output_dtype)


class _CastParams:
    # One module's parameters in param_dtype for the length of its forward.
    __slots__ = ("names", "dtype", "saved")

    def __init__(self, names: Sequence[str], dtype: torch.dtype) -> None:
        self.names = list(names)
        self.dtype = dtype
        self.saved: list[list[Optional[nn.Parameter]]] = []  # a stack: a module may call itself

    def before(self, module: nn.Module, args: Any) -> None:
        params = parameters_of(module)
        originals = [params[name] for name in self.names]
        self.saved.append(originals)
        for name, param in zip(self.names, originals, strict=True):
            if param is not None:
                # not through setattr: a plain tensor in _parameters for the forward only,
                # and no global registration hook runs ([Note: re-planning] in plan.py)
                params[name] = param.to(self.dtype)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        originals = self.saved.pop()
        params = parameters_of(module)
        for name, param in zip(self.names, originals, strict=True):
            params[name] = param


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        cast = [_cast_floating(item, dtype) for item in value]
        return type(value)(cast) if not hasattr(value, "_fields") else type(value)(*cast)
    if isinstance(value, dict):
        return {key: _cast_floating(item, dtype) for key, item in value.items()}
    return value
