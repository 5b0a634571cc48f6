"""DDP's attributes and methods on a replicated module: each behaves as DDP's, or says what to use.

Code written for ``DistributedDataParallel`` (nanoGPT, Lightning, accelerate,
torchrec) reads and sets attributes of the wrapper and calls its methods.
``ReplicateModule`` derives from ``DDPSurface``, so a replicated module
answers each of them as DDP 2.13 does on the same job, or raises naming the
replacement; none is ignored in silence.
"""

from __future__ import annotations

from typing import Any

from torchreplicate.core.plan import IGNORE_ATTRIBUTE, check_ignored_names
from torchreplicate.core.registry import get_state


class DDPSurface:
    """DDP's attributes and methods, as a replicated module offers them (see the module docstring)."""

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's public switch, the same state as ``set_requires_gradient_sync``.

        ``model.require_backward_grad_sync = False`` makes the next backwards
        accumulate locally, as under DDP (and as ``no_sync()``, which sets it).
        """
        return get_state(self).requires_gradient_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        get_state(self).set_requires_gradient_sync(value)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        """DDP's names of parameters and buffers left alone: neither averaged nor broadcast.

        Set before ``replicate()`` (``DistributedDataParallel.
        _set_params_and_buffers_to_ignore_for_model(model, names)``, as
        torchrec does) or after it: then the next forward with gradients
        re-plans without them ([Note: re-planning] in core/plan.py), so set it
        on every rank. Unset, reading it raises ``AttributeError``, as on a
        plain module. The names stay in the module's ``__dict__``, where DDP's
        helper puts them, so copies and pickles keep them.
        """
        try:
            return vars(self)[IGNORE_ATTRIBUTE]
        except KeyError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {IGNORE_ATTRIBUTE!r}") from None

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names: Any) -> None:
        check_ignored_names(names)
        vars(self)[IGNORE_ATTRIBUTE] = names
        get_state(self).note_change()

    @_ddp_params_and_buffers_to_ignore.deleter
    def _ddp_params_and_buffers_to_ignore(self) -> None:
        vars(self).pop(IGNORE_ATTRIBUTE, None)
        get_state(self).note_change()
