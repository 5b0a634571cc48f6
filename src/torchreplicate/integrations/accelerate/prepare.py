"""``prepare_model(accelerator, model)``: accelerate's preparation of a model, with ``replicate()`` in place of DDP.

[Note: accelerate]
Where accelerate 1.16 would wrap the model in ``DistributedDataParallel`` (a
multi-device or multi-CPU run with no FSDP, DeepSpeed, Megatron-LM, XLA or
tensor / context / sequence parallelism, and trainable parameters), the
model is moved to ``accelerator.device`` and replicated in place, with the
options of the accelerator's ``DistributedDataParallelKwargs`` that mean the
same here (``bucket_cap_mb``, ``broadcast_buffers``,
``gradient_as_bucket_view``; ``dim`` and ``check_reduction`` go to
``replicate()``, which gives them DDP's meaning) and its comm hook, through
accelerate's own ``register_comm_hook``. Then accelerate's public
``Accelerator.prepare_model(model, evaluation_mode=True)`` does everything
its ``prepare_model`` does (autocast for mixed precision, ``torch.compile``,
registration for ``save_state``, the "prepared" mark) except the DDP wrap,
as ``transformers.Trainer`` itself does for models that reduce their own
gradients. A prepared model is left alone by later ``prepare`` calls, so DDP
never lands on a replicated model. ``find_unused_parameters`` and
``static_graph`` change nothing here (unused parameters are always handled,
the graph is learned), and the Trainer sets the first by default: they are
dropped without a warning.

Limits: a plain ``Accelerator``'s ``trigger_sync_in_backward(model)`` does
nothing for a replicated model (accelerate looks for DDP);
``ReplicateAccelerator``'s turns the sync on for its block. The sync switch
is read when a backward runs, not at its forward as in DDP: a backward
outside ``accelerator.no_sync(model)`` averages, also for a loss whose
forward ran inside it (the same result as DDP's, one all-reduce more); put
the backwards that should not average inside ``no_sync``. Not run: GPUs,
``join_uneven_inputs``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

from accelerate import Accelerator  # type: ignore[import-untyped]  # accelerate 1.16 ships no py.typed
from accelerate.utils import DDPCommunicationHookType, DistributedType  # type: ignore[import-untyped]
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchreplicate.api import replicate
from torchreplicate.core.registry import enclosing_state, find_state
from torchreplicate.integrations.options import check_replicate_options

# Where accelerate 1.16's prepare_model wraps a model in DDP: Accelerator.multi_device's types, and MULTI_CPU
# (together, every MULTI_* type of 1.16)
WRAPPED_IN_DDP = frozenset(kind for kind in DistributedType if kind.name.startswith("MULTI_"))
_OTHER_PARALLELISMS = tuple(DistributedType[name] for name in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"))
ROLE = "accelerate"  # what sets the device and the group, in check_replicate_options' messages


def check_options(
    options: dict[str, Any], caller: str, also: str = "(and the Accelerator's arguments)"
) -> dict[str, Any]:
    """``replicate()``'s options for ``caller``, checked by name and value (a copy).

    Raises:
        TypeError / ValueError: an unknown option, one accelerate decides, or a bad value.
    """
    return check_replicate_options(options, caller, role=ROLE, also=also)


def refuse_unsupported(accelerator: Any, caller: str = "prepare_model()") -> None:
    """Refuses an accelerator configured for another parallelism; warns where it is not distributed.

    Every rank holds the same configuration, so every rank raises the same error.

    Args:
        accelerator: the ``Accelerator`` (its ``distributed_type`` and
            ``parallelism_config`` are read).
        caller: the entry point's name, for messages. Default ``"prepare_model()"``.

    Raises:
        ValueError: FSDP, DeepSpeed, Megatron-LM, XLA, or tensor, context,
            sequence or sharded data parallelism configured.
    """
    kind = accelerator.distributed_type
    if kind in _OTHER_PARALLELISMS:
        raise ValueError(
            f"torchreplicate {caller}: the accelerator is configured for {kind.value}, which shards or wraps the "
            "model itself; replicate() replaces DDP only: drop the "
            f"{kind.value} configuration (accelerate config, ACCELERATE_USE_* variables, the Trainer's "
            "fsdp / deepspeed arguments), or train without torchreplicate"
        )
    config = getattr(accelerator, "parallelism_config", None)
    if enabled := [name for name in ("tp", "cp", "sp", "dp_shard") if getattr(config, f"{name}_enabled", False)]:
        raise ValueError(
            f"torchreplicate {caller}: the accelerator's parallelism_config enables {', '.join(enabled)} "
            f"({config!r}); replicate() replaces DDP only: set those sizes to 1, or train without torchreplicate"
        )
    world_size = os.environ.get("WORLD_SIZE", "1")
    if kind == DistributedType.NO and world_size.isdigit() and int(world_size) > 1:
        warnings.warn(
            f"torchreplicate {caller}: WORLD_SIZE is {world_size} but accelerate is not distributed "
            "(distributed_type NO): each process trains alone and nothing is replicated. On CPU, accelerate "
            "needs ACCELERATE_USE_CPU=true in the environment (or Accelerator(cpu=True), "
            "TrainingArguments(use_cpu=True))",
            UserWarning,
            stacklevel=3,
        )


def replicate_options_from(accelerator: Any) -> dict[str, Any]:
    """``replicate()``'s options from the accelerator's ``DistributedDataParallelKwargs``: those set.

    ``bucket_cap_mb``, ``broadcast_buffers`` and ``gradient_as_bucket_view``
    keep their names; ``dim`` and ``check_reduction`` stay DDP arguments
    (``replicate()`` gives them DDP's meaning); ``find_unused_parameters``
    and ``static_graph`` are dropped (no effect here). The comm hook is not
    an option: ``prepare_model`` registers it.

    Args:
        accelerator: the ``Accelerator``.

    Returns:
        The options set to something other than accelerate's default.
    """
    handler = getattr(accelerator, "ddp_handler", None)
    given = handler.to_kwargs() if handler is not None else {}  # accelerate's: only what differs from the default
    # DDP's keyword options that change nothing here: dropped in silence (the Trainer always sets
    # find_unused_parameters)
    return {name: value for name, value in given.items() if name not in ("find_unused_parameters", "static_graph")}


def prepare_model(accelerator: Accelerator, model: nn.Module, **replicate_options: Any) -> nn.Module:
    """Prepares ``model`` as ``accelerator.prepare_model`` does, replicated instead of wrapped in DDP.

    See [Note: accelerate]. Call it on every rank before ``accelerator.prepare``
    (which then leaves the model alone), with a ``transformers.Trainer``'s
    ``Accelerator`` or your own.

    Example::

        accelerator = Accelerator(mixed_precision="bf16")
        model = prepare_model(accelerator, model, bucket_cap_mb=25)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    Args:
        accelerator: the ``Accelerator``.
        model: the model: plain, or already replicated (it then keeps the
            options it was replicated with; pass none here).
        **replicate_options: ``replicate()``'s keyword options; they win over
            those read from the accelerator's ``DistributedDataParallelKwargs``.
            Not ``device_id``, ``process_group`` or a mesh: accelerate decides
            the device, and its data loaders split the data over all its processes.

    Returns:
        ``model`` itself, replicated and prepared (as accelerate returns it:
        the same object, its ``forward`` under autocast where mixed precision is on).

    Raises:
        ValueError: the accelerator is configured for FSDP, DeepSpeed,
            Megatron-LM, XLA or tensor / context parallelism; ``model`` is
            wrapped in DDP already; options given for a model already replicated.
        TypeError: an unknown option, or a bad value (named).
    """
    options = check_options(replicate_options, "prepare_model()")
    return replicate_and_prepare(accelerator, model, options, device_placement=None)


def replicate_and_prepare(
    accelerator: Accelerator, model: nn.Module, options: dict[str, Any], *, device_placement: Optional[bool]
) -> nn.Module:
    """``prepare_model``'s work, for options already checked; ``device_placement`` as accelerate's.

    Args:
        accelerator: the ``Accelerator``.
        model: the model.
        options: ``replicate()``'s options, checked.
        device_placement: move the model to ``accelerator.device`` first;
            None: as the accelerator says.
    """
    refuse_unsupported(accelerator)
    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "torchreplicate prepare_model(): the model is wrapped in DistributedDataParallel already (was it passed "
            "to accelerator.prepare first?); pass the plain model, before accelerator.prepare"
        )
    if find_state(model) is None and enclosing_state(model) is not None:
        raise ValueError(
            f"torchreplicate prepare_model(): this {type(model).__name__} is inside a replicated model; prepare the "
            "replicated model itself"
        )
    if accelerator.distributed_type in WRAPPED_IN_DDP and any(p.requires_grad for p in model.parameters()):
        # On the accelerator's device, with its DDP options and comm hook; a model replicated already keeps its own.
        from_accelerator = replicate_options_from(accelerator)
        handler = getattr(accelerator, "ddp_handler", None)
        comm_hook = handler is not None and handler.comm_hook != DDPCommunicationHookType.NO
        if find_state(model) is None:
            if accelerator.device_placement if device_placement is None else device_placement:
                model.to(accelerator.device)  # before replicate(): its buckets are built where the parameters live
            replicate(model, **{**from_accelerator, **options})
            if comm_hook:  # accelerate's own registration: model.register_comm_hook(state, hook)
                accelerator.ddp_handler.register_comm_hook(model)
        elif options:
            raise ValueError(
                f"torchreplicate prepare_model(): this {type(model).__name__} is already replicated, with its own "
                f"options; {', '.join(f'{name}=' for name in options)} would not apply: pass them to replicate(), "
                "or pass the plain model here"
            )
        elif (skipped := [f"{name}={value!r}" for name, value in from_accelerator.items()]) or comm_hook:
            warnings.warn(
                "torchreplicate prepare_model(): the model is already replicated and keeps its own options; the "
                f"accelerator's DistributedDataParallelKwargs ({', '.join(skipped) or 'its comm hook'}) are not "
                "applied: pass them to replicate() instead",
                UserWarning,
                stacklevel=3,
            )
    return accelerator.prepare_model(model, device_placement=device_placement, evaluation_mode=True)  # type: ignore[no-any-return]
