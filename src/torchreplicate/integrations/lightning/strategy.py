"""What the Trainer's and Fabric's ``ReplicateStrategy`` share: ``replicate()`` with the options they were built with.

Needs nothing from Lightning: each strategy derives from this first, then
from its own ``DDPStrategy``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torchreplicate.api import replicate
from torchreplicate.integrations.options import refuse_replicated

NAME = "replicate"  # strategy="replicate"


class ReplicatingStrategy:
    """The part of both strategies that is not Lightning's: their options, ``replicate()``, their registration."""

    _replicate_options: dict[str, Any]  # checked by check_replicate_options in the strategy's __init__

    @property
    def replicate_options(self) -> dict[str, Any]:
        """The options passed to ``replicate()`` (a copy)."""
        return dict(self._replicate_options)

    def _replicate(self, module: nn.Module) -> nn.Module:
        # Refuses a module replicate() was applied to elsewhere, then replicates it in place.
        refuse_replicated(module, type(self).__name__)
        return replicate(module, **self._replicate_options)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers the strategy as ``"replicate"`` (done when its module is imported)."""
        if NAME not in strategy_registry:
            strategy_registry.register(NAME, cls, description="Data parallel with torchreplicate's replicate()")
