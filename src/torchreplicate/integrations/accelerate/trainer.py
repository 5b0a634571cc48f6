"""``ReplicateTrainer``: a ``transformers.Trainer`` whose model is replicated instead of wrapped in DDP."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn
from transformers import Trainer

from torchreplicate.core.registry import find_state
from torchreplicate.integrations.accelerate.prepare import check_options, refuse_unsupported, replicate_and_prepare


class ReplicateTrainer(Trainer):
    """A ``transformers.Trainer`` whose model is replicated instead of wrapped in DDP.

    The model, or each one ``model_init`` builds (a hyperparameter search),
    goes through ``prepare_model`` when training starts, through the
    Trainer's public ``train`` and ``call_model_init``; the Trainer's own
    ``accelerator.prepare`` then leaves it alone ([Note: accelerate] in
    prepare.py). Everything else is the Trainer's: accumulation, clipping,
    evaluation, checkpoints, ``save_model``, resuming (also from a checkpoint
    a Trainer with DDP wrote: the keys are the same). Launch it as the Trainer
    with DDP (``torchrun``; on CPU with ``TrainingArguments(use_cpu=True)``).

    Example::

        trainer = ReplicateTrainer(model=model, args=args, train_dataset=data, replicate_options={})
        trainer.train()

    Args:
        *trainer_args: ``Trainer``'s own positional arguments, passed as given.
        replicate_options: ``replicate()``'s keyword options (checked here, on
            every rank). Not ``device_id``, ``process_group`` or a mesh.
            Default none.
        **trainer_options: ``Trainer``'s own keyword arguments (``model``,
            ``args``, ``model_init``, ...), passed as given.

    Raises:
        TypeError / ValueError: an unknown option or a bad value; FSDP,
            DeepSpeed or tensor / context parallelism configured.
    """

    def __init__(
        self, *trainer_args: Any, replicate_options: Optional[dict[str, Any]] = None, **trainer_options: Any
    ) -> None:
        self._replicate_options = check_options(
            dict(replicate_options or {}), type(self).__name__, also="(and the Trainer's arguments)"
        )
        super().__init__(*trainer_args, **trainer_options)

    @property
    def replicate_options(self) -> dict[str, Any]:
        """The options passed to ``replicate()`` (a copy)."""
        return dict(self._replicate_options)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's ``Accelerator``, refused at once (every rank) if configured for FSDP, DeepSpeed, TP or CP."""
        super().create_accelerator_and_postprocess()
        refuse_unsupported(self.accelerator, type(self).__name__)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, the model replicated first (or, with ``model_init``, each model as it is built).

        Args:
            *args: ``Trainer.train``'s positional arguments.
            **kwargs: ``Trainer.train``'s keyword arguments (``resume_from_checkpoint``, ``trial``, ...).
        """
        if self.model_init is None:
            self._replicate(self.model)
        return super().train(*args, **kwargs)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """``Trainer.call_model_init``; inside ``train`` the new model is replicated and prepared.

        Args:
            trial: as ``Trainer.call_model_init``'s.
        """
        model = super().call_model_init(trial)
        if getattr(self, "is_in_train", False):  # not yet set when Trainer.__init__ builds its first model
            self._replicate(model)
        return model

    def _replicate(self, model: nn.Module) -> None:
        # a model replicated before (a second train()) keeps its options
        options = {} if find_state(model) is not None else self._replicate_options
        replicate_and_prepare(self.accelerator, model, options, device_placement=None)
