"""``ReplicateStrategy`` for Lightning ``Fabric``: its DDPStrategy, with ``replicate()`` instead of the DDP wrapper.

``fabric.setup(model, optimizer)`` replicates ``model`` in place (Fabric's
``_FabricModule`` then wraps it, as it wraps any module);
``fabric.no_backward_sync(model)`` is ``model.no_sync()``; everything else
(launching, ``barrier``, ``broadcast``, ``all_reduce``, ``save``/``load``)
is Fabric's DDPStrategy.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal, Optional

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from torchreplicate.core.registry import find_state
from torchreplicate.integrations.lightning.strategy import ReplicatingStrategy
from torchreplicate.integrations.options import check_replicate_options


class ReplicateStrategy(ReplicatingStrategy, DDPStrategy):
    """Data parallelism for ``Fabric`` with torchreplicate's reducer: ``Fabric(strategy=ReplicateStrategy())``.

    Args:
        accelerator: as ``lightning.fabric.strategies.DDPStrategy``'s, like the next six
            (Fabric fills most of them in).
        parallel_devices: as ``DDPStrategy``'s.
        cluster_environment: as ``DDPStrategy``'s.
        checkpoint_io: as ``DDPStrategy``'s.
        precision: as ``DDPStrategy``'s.
        process_group_backend: as ``DDPStrategy``'s.
        timeout: as ``DDPStrategy``'s.
        start_method: as ``DDPStrategy``'s. Default ``"popen"``.
        **replicate_options: ``replicate()``'s keyword options, checked here
            on every rank. Not ``device_id``, ``process_group`` or a mesh:
            the strategy sets those.

    Raises:
        TypeError / ValueError: an unknown option, or a bad value.
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Optional[list[Any]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
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
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _ReplicateBackwardSyncControl()

    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]  # DDP there
        """Replicates ``module`` in place and returns it."""
        return self._replicate(module)


class _ReplicateBackwardSyncControl(_BackwardSyncControl):
    # fabric.no_backward_sync(model): Fabric's interface (lightning 2.6), our no_sync().
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if find_state(module) is None:
            raise TypeError(
                "ReplicateStrategy.no_backward_sync: expected the module set up by fabric.setup() "
                f"(replicated), got a {type(module).__name__} that is not"
            )
        return module.no_sync()  # type: ignore[operator, no-any-return]  # a ReplicateModule method


ReplicateStrategy.register_strategies(STRATEGY_REGISTRY)
