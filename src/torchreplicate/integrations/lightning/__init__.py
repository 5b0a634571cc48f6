"""torchreplicate for Lightning: ``ReplicateStrategy`` for the ``Trainer`` and for ``Fabric``.

Importing this package registers both under the name ``"replicate"``, so
``Trainer(strategy="replicate")`` and ``Fabric(strategy="replicate")`` work
after ``import torchreplicate.integrations.lightning``. Needs the
``lightning`` package (the ``lightning`` extra: ``pip install ".[lightning]"`` in a clone).
"""

from torchreplicate.integrations.lightning.fabric import ReplicateStrategy as FabricReplicateStrategy
from torchreplicate.integrations.lightning.trainer import ReplicateStrategy

__all__ = ["FabricReplicateStrategy", "ReplicateStrategy"]
