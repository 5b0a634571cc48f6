"""``ReplicateStrategy`` for the Lightning ``Trainer``: DDPStrategy, with ``replicate()`` instead of the DDP wrapper.

Everything but the gradient reduction is Lightning's DDPStrategy: launching,
process group set-up, samplers, ``barrier``, ``broadcast``, ``reduce`` (and
so ``self.log(..., sync_dist=True)``), checkpointing. The LightningModule is
replicated in place, so ``trainer.model`` is the LightningModule itself:
no ``.module`` to unwrap, the same ``state_dict`` keys.

Limits: DDPStrategy's ``ddp_comm_*`` and ``model_averaging_period`` options
are not taken (register a comm hook on ``trainer.model`` instead; see
docs/integrations.md). The module stays replicated after ``fit``: fit a fresh module, or
the same one with the same strategy object again, not with a new strategy.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Iterator, Literal, Optional

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn

from torchreplicate.core.registry import find_state
from torchreplicate.integrations.lightning.strategy import ReplicatingStrategy
from torchreplicate.integrations.options import check_replicate_options

log = logging.getLogger(__name__)


class ReplicateStrategy(ReplicatingStrategy, DDPStrategy):
    """Data parallelism for ``Trainer`` with torchreplicate's reducer: ``Trainer(strategy=ReplicateStrategy())``.

    Args:
        accelerator: as ``lightning.pytorch.strategies.DDPStrategy``'s, like the next six
            (the Trainer fills most of them in).
        parallel_devices: as ``DDPStrategy``'s.
        cluster_environment: as ``DDPStrategy``'s.
        checkpoint_io: as ``DDPStrategy``'s.
        precision_plugin: as ``DDPStrategy``'s.
        process_group_backend: as ``DDPStrategy``'s.
        timeout: as ``DDPStrategy``'s.
        start_method: as ``DDPStrategy``'s. Default ``"popen"``.
        **replicate_options: ``replicate()``'s keyword options
            (``bucket_cap_mb``, ``broadcast_buffers``, ``reduce_dtype``, ...),
            checked here on every rank. Not ``device_id``, ``process_group``
            or a mesh: the strategy sets those.

    Raises:
        TypeError / ValueError: an unknown option, or a bad value.
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Optional[list[Any]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **replicate_options: Any,
    ) -> None:
        self._replicate_options = check_replicate_options(replicate_options, type(self).__name__)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        # the module this strategy replicated: a second fit() with the same Trainer finds it so
        self._replicated_model: Optional[nn.Module] = None

    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]  # DDPStrategy wraps in DDP
        if find_state(model) is not None and model is self._replicated_model:
            return model  # a second fit() with this strategy: already ours
        log.debug(f"{type(self).__name__}: replicate(model, **{self._replicate_options})")
        self._replicated_model = self._replicate(model)
        return model

    def _register_ddp_hooks(self) -> None:
        pass  # DDP's comm-hook options are not taken (see the module docstring)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs ``training_step`` through the module's ``__call__``, as DDPStrategy does through DDP's forward.

        So the forward hooks of ``replicate()`` run before the step (buffer
        broadcast, re-plan check), however the step calls its layers.
        """
        module = self.lightning_module
        if module is None or find_state(module) is None:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return call_through_forward(module, "training_step", *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally (gradient accumulation); the Trainer uses it between steps."""
        module = self.model
        # no_sync(): a ReplicateModule method
        with nullcontext() if module is None or find_state(module) is None else module.no_sync():  # type: ignore[operator]
            yield


def call_through_forward(module: nn.Module, method_name: str, *args: Any, **kwargs: Any) -> Any:
    """``module.<method_name>(*args, **kwargs)``, called through ``module(...)`` so its forward hooks run.

    ``forward`` is replaced on the instance for this one call (Lightning's
    forward redirection, which DDPStrategy uses with the DDP wrapper) and
    restored before the method runs, so the method may call ``self(x)``.
    """
    own_forward = module.__dict__.get("forward")

    def restore() -> None:
        module.__dict__.pop("forward", None)
        if own_forward is not None:
            module.forward = own_forward

    def redirected(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore()
        return getattr(module, method_name)(*inner_args, **inner_kwargs)

    module.forward = redirected
    try:
        return module(*args, **kwargs)
    finally:
        restore()


ReplicateStrategy.register_strategies(StrategyRegistry)
