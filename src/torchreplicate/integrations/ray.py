"""Ray Train: ``prepare_model(model)`` does what Ray's does for DDP, with ``replicate()`` in place of the wrap.

[Note: Ray Train]
Ray Train's ``TorchTrainer`` starts the workers and their process group
(gloo on CPU, NCCL on GPU), and ``ray.train.torch.prepare_model(model)``
moves the model to the worker's device (setting it current on an
accelerator), wraps its forward in autocast where Ray's AMP is on, and then
wraps the model in ``DistributedDataParallel`` (``parallel_strategy="ddp"``,
the default) or FSDP. Ray offers no registration point for another strategy
(Ray 2.60: the strategy is a string checked against those two), so this
``prepare_model`` calls Ray's with ``parallel_strategy=None`` (everything
but the wrap, as Ray documents for models a user wraps themselves) and then
``replicate()``, with ``device_id`` the device Ray chose where it is an
accelerator (DDP's ``device_ids``, which Ray passes). Ray's
``parallel_strategy_kwargs`` are DDP's arguments, taken with DDP's meaning
as ``replicate()`` takes them (compat/ddp_args.py); the keyword options are
``replicate()``'s own. ``prepare_data_loader`` and everything else of Ray's
(reports, checkpoints, restarts) work unchanged. Tested on a local Ray
cluster of CPU workers (tests/test_ray.py); not run: GPUs, several nodes.
Importing this module needs Ray Train: ``pip install 'torchreplicate[ray]'``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from ray.train.torch import prepare_model as ray_prepare_model
from torch import nn

from torchreplicate.api import replicate
from torchreplicate.integrations.options import check_replicate_options, refuse_replicated

_NAME = "torchreplicate.integrations.ray.prepare_model"


def prepare_model(
    model: nn.Module,
    move_to_device: Union[bool, torch.device] = True,
    parallel_strategy: Optional[str] = "ddp",
    parallel_strategy_kwargs: Optional[dict[str, Any]] = None,
    **options: Any,
) -> nn.Module:
    """Ray Train's ``prepare_model``, with ``replicate()`` where Ray would wrap the model in DDP.

    Call it inside the training function of a ``TorchTrainer``, on every
    worker, in place of ``ray.train.torch.prepare_model`` ([Note: Ray Train]).

    Args:
        model: the plain model (not replicated, not wrapped).
        move_to_device: as Ray's: move the model to the worker's device (True), to this device, or not at all.
        parallel_strategy: ``"ddp"`` (default, Ray's): replicate the model; ``None``: only Ray's preparation,
            as Ray's. Ray's ``"fsdp"`` is refused.
        parallel_strategy_kwargs: DDP's constructor arguments, as Ray passes them to DDP; ``replicate()``
            takes them with DDP's meaning.
        **options: ``replicate()``'s own keyword options (``bucket_layout``, ``stall_timeout``, ...).

    Returns:
        The model itself, prepared by Ray and replicated in place.

    Raises:
        ValueError: ``parallel_strategy`` is neither ``"ddp"`` nor None.
        TypeError: options with ``parallel_strategy=None`` (nothing to replicate), or an option given twice.
        RuntimeError: the model is already replicated.
    """
    if parallel_strategy not in ("ddp", None):
        raise ValueError(
            f"{_NAME}: parallel_strategy={parallel_strategy!r} is not taken: ours replaces Ray's 'ddp' (the "
            "default). For sharding, use torch's fully_shard on the model yourself (replicate() composes with "
            "it: docs/migration.md, With fully_shard) and pass parallel_strategy=None, or use Ray's own "
            "ray.train.torch.prepare_model(model, parallel_strategy='fsdp') without torchreplicate"
        )
    given = {**(parallel_strategy_kwargs or {}), **options}
    if parallel_strategy is None and given:
        raise TypeError(f"{_NAME}: parallel_strategy=None replicates nothing, so {', '.join(given)} would be ignored")
    if twice := sorted(set(parallel_strategy_kwargs or {}) & set(options)):
        raise TypeError(
            f"{_NAME}: {', '.join(twice)} given both in parallel_strategy_kwargs and as options; pass it once"
        )
    refuse_replicated(model, _NAME)
    checked = check_replicate_options(options, _NAME, role="Ray Train", also="")
    model = ray_prepare_model(model, move_to_device=move_to_device, parallel_strategy=None)
    if parallel_strategy is None:
        return model
    arguments = {**(parallel_strategy_kwargs or {}), **checked}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cpu" and not {"device_ids", "device_id"} & set(arguments):
        arguments["device_id"] = device  # Ray passes device_ids=[device] to DDP on an accelerator
    return replicate(model, **arguments)
