"""torchreplicate for Hugging Face: accelerate and ``transformers.Trainer``, with the model replicated instead of DDP.

Three entry points, one mechanism ([Note: accelerate] in prepare.py):

- ``prepare_model(accelerator, model, **replicate_options)``: for an
  ``Accelerator`` you did not create (a Trainer's), or keep as it is;
- ``ReplicateAccelerator(replicate_options=...)``: an ``Accelerator`` whose
  ``prepare(model, optimizer, dataloader)`` replicates the model;
- ``ReplicateTrainer(..., replicate_options=...)``: a ``transformers.Trainer``
  that does, also for the models ``model_init`` builds (hyperparameter search).

Needs the ``accelerate`` package (the ``accelerate`` extra: ``pip install
".[accelerate]"`` in a clone); ``ReplicateTrainer`` needs ``transformers``
too, imported only when ``ReplicateTrainer`` is first used. Checked with
accelerate 1.16.0 and transformers 5.25.0 on torch 2.13 (gloo, CPU).
"""

from __future__ import annotations

from typing import Any

from torchreplicate.integrations.accelerate.accelerator import ReplicateAccelerator
from torchreplicate.integrations.accelerate.prepare import prepare_model, refuse_unsupported, replicate_options_from

__all__ = ["ReplicateAccelerator", "ReplicateTrainer", "prepare_model", "refuse_unsupported", "replicate_options_from"]


def __getattr__(name: str) -> Any:
    # ReplicateTrainer on first use: importing transformers takes seconds, and accelerate alone does not need it
    if name == "ReplicateTrainer":
        from torchreplicate.integrations.accelerate.trainer import ReplicateTrainer

        return ReplicateTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
