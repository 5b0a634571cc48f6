"""Loading a checkpoint that was saved from a DDP-wrapped model.

``DistributedDataParallel(model).state_dict()`` prefixes every key with
``module.``; ``replicate`` does not wrap, so the replicated model's keys have
no prefix. ``load_ddp_state_dict`` strips the prefix with torch's own helper
(``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present``, on a
copy) and loads. The other way
round needs nothing: a replicated model's ``state_dict()`` loads into
``ddp.module`` as it is. An optimizer's state dict is keyed by parameter
position, not name, and loads unchanged either way.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

__all__ = ["DDP_PREFIX", "load_ddp_state_dict"]

DDP_PREFIX = "module."  # what DistributedDataParallel's state_dict() puts before every key


def load_ddp_state_dict(module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> Any:
    """Loads a state dict saved from ``DistributedDataParallel(module)`` into ``module``.

    The ``module.`` prefix DDP adds to every key is removed, then
    ``module.load_state_dict`` copies the values in place (the replicated
    parameters keep their storage, so gradient buckets stay valid). Keys
    without the prefix load as they are, so the same call also loads a
    checkpoint saved from the replicated model itself. A model whose own keys
    begin with ``module.`` (a child named ``module``) is loaded without
    stripping where the keys already match it.

    Args:
        module: the model, replicated or not.
        state_dict: as ``torch.load`` returned it; not modified.
        strict: as ``nn.Module.load_state_dict``'s. Default True: missing or
            unexpected keys raise ``RuntimeError`` naming them.

    Returns:
        ``load_state_dict``'s result: the missing and unexpected keys.

    Raises:
        TypeError: ``state_dict`` is not a mapping.
        RuntimeError: from ``load_state_dict`` (wrong keys under ``strict``,
            wrong shapes).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"load_ddp_state_dict(): state_dict must be a mapping of names to tensors, got "
            f"{type(state_dict).__name__}; pass what torch.load(path) returned for ddp_model.state_dict()"
        )
    own_keys = set(module.state_dict().keys())
    if set(state_dict.keys()) == own_keys:  # already in this model's names (saved without DDP)
        return module.load_state_dict(state_dict, strict=strict)
    stripped: OrderedDict[str, Any] = OrderedDict(state_dict)  # torch's helper renames in place: a copy
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # per-submodule versions (BatchNorm reads its own): renamed alike
        stripped._metadata = OrderedDict(metadata)  # type: ignore[attr-defined]  # torch's own convention
    consume_prefix_in_state_dict_if_present(stripped, DDP_PREFIX)
    return module.load_state_dict(stripped, strict=strict)
