"""``ReplicateAccelerator``: an ``Accelerator`` whose ``prepare`` replicates the model instead of wrapping it in DDP."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from accelerate import Accelerator  # type: ignore[import-untyped]  # accelerate 1.16 ships no py.typed
from torch import nn

from torchreplicate.core.registry import find_state
from torchreplicate.integrations.accelerate.prepare import check_options, refuse_unsupported, replicate_and_prepare


class ReplicateAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` replicates the model instead of wrapping it in DDP.

    Everything else is accelerate's: ``prepare`` for data loaders, optimizers
    and schedulers, ``accumulate``, ``backward``, ``clip_grad_norm_``,
    ``save_state`` / ``load_state``. ``no_sync(model)`` is the model's
    ``no_sync()``, and ``trigger_sync_in_backward(model)`` turns the model's
    gradient sync on for its block ([Note: accelerate] in prepare.py).

    Example::

        accelerator = ReplicateAccelerator(mixed_precision="bf16", replicate_options={"bucket_cap_mb": 25})
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    Args:
        replicate_options: ``replicate()``'s keyword options (checked here,
            on every rank); they win over the ``DistributedDataParallelKwargs``
            of ``kwargs_handlers``. Not ``device_id``, ``process_group`` or a
            mesh. Default none.
        **accelerator_options: ``Accelerator``'s own keyword arguments
            (``mixed_precision``, ``gradient_accumulation_steps``,
            ``kwargs_handlers``, ...), passed to it as given: listing its
            two dozen here would break with each accelerate release.

    Raises:
        TypeError / ValueError: an unknown option or a bad value; an
            accelerator configured for FSDP, DeepSpeed, Megatron-LM, XLA or
            tensor / context parallelism.
    """

    def __init__(self, *, replicate_options: Optional[dict[str, Any]] = None, **accelerator_options: Any) -> None:
        self._replicate_options = check_options(dict(replicate_options or {}), type(self).__name__)
        super().__init__(**accelerator_options)
        refuse_unsupported(self, type(self).__name__)

    @property
    def replicate_options(self) -> dict[str, Any]:
        """The options passed to ``replicate()`` (a copy)."""
        return dict(self._replicate_options)

    def prepare_model(
        self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Accelerate's ``prepare_model``, with the model replicated where accelerate would wrap it in DDP.

        Args:
            model: the model (plain, or replicated already: it then keeps its options).
            device_placement: as accelerate's. Default None: the accelerator's.
            evaluation_mode: as accelerate's: True only applies mixed
                precision and compilation (nothing replicated). Default False.
        """
        if evaluation_mode:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)  # type: ignore[no-any-return]
        options = {} if find_state(model) is not None else self._replicate_options
        return replicate_and_prepare(self, model, options, device_placement=device_placement)

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: nn.Module) -> Iterator[None]:
        """Backwards inside average the gradients, also inside ``no_sync`` (accelerate's, for a replicated model).

        Args:
            model: the prepared model.
        """
        state = find_state(model)
        if state is None:  # a model wrapped in DDP by a plain Accelerator: accelerate's
            with Accelerator.trigger_sync_in_backward(model):
                yield
            return
        previous = state.requires_gradient_sync
        state.set_requires_gradient_sync(True)
        try:
            yield
        finally:
            state.set_requires_gradient_sync(previous)
