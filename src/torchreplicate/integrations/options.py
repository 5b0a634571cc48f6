"""The ``replicate()`` options a framework integration accepts, checked when it is built.

The Lightning strategies (Trainer and Fabric) and the accelerate entry
points (``ReplicateAccelerator``, ``ReplicateTrainer``) take
``replicate()``'s keyword options by name. Unknown names and bad values are
refused in the constructor, which runs on every rank (before any process
group, for Lightning), so every rank raises the same error.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from torchreplicate.api import replicate
from torchreplicate.compat.ddp_args import DDP_POSITIONAL_ORDER
from torchreplicate.config import ReplicateConfig, to_ignored_modules
from torchreplicate.core.registry import enclosing_state, find_state

# The integration decides these: the module is on the framework's device and
# is averaged over the world group, which the framework's sampler splits the
# data over; another group would average over the wrong ranks.
_DEVICE = "{role} moves the module to its device"
_GROUP = "{role} averages over all its processes, as its sampler splits the data"
_SET_BY_FRAMEWORK = {"device_id": _DEVICE, "process_group": _GROUP, "mesh": _GROUP, "device_mesh": _GROUP}
_LIGHTNING_ALSO = "(and those of Lightning's DDPStrategy but its ddp_comm_* and model_averaging_period)"

# DDP's constructor arguments that replicate() takes (compat/ddp_args.py) and the
# integrations do not (they take replicate()'s own options): what to pass instead.
_DDP_ARGUMENT_INSTEAD = {
    "init_sync": (
        "under {role} every rank starts from rank 0's weights; to keep each rank's own, call "
        "replicate(model, init_sync=False) in a loop of your own"
    ),
    "device_ids": _DEVICE,
    "output_device": _DEVICE,
    "forward_sync_buffers": (
        "pass broadcast_buffers= (False skips the broadcast before forwards, and the one at set-up, which "
        "forward_sync_buffers=False keeps)"
    ),
}


def replicate_option_names() -> list[str]:
    """The keyword options of ``replicate()`` an integration passes on (all but those it sets itself)."""
    parameters = inspect.signature(replicate).parameters.values()
    return [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.name not in _SET_BY_FRAMEWORK]


def check_replicate_options(
    options: dict[str, Any], strategy: str, *, role: str = "the strategy", also: str = _LIGHTNING_ALSO
) -> dict[str, Any]:
    """Checks the names and values of ``options``; returns a copy.

    Args:
        options: keyword options for ``replicate()``.
        strategy: the strategy's (or other integration's) name, for messages.
        role: what sets the device and the group, for messages. Default ``"the strategy"``.
        also: what else the integration takes, said after the list of options
            when a name is unknown. Default: Lightning's DDPStrategy options.

    Raises:
        TypeError: an unknown option, or one the integration sets itself.
        TypeError / ValueError: a bad value (``replicate()``'s own message).
    """
    known = replicate_option_names()
    for name in (name for name in options if name not in known):  # the first name not taken raises
        if name in _SET_BY_FRAMEWORK:
            raise TypeError(f"{strategy}: {name}= is not accepted: {_SET_BY_FRAMEWORK[name].format(role=role)}")
        if name in DDP_POSITIONAL_ORDER:
            default = f"pass replicate()'s own options ({', '.join(known)})"
            instead = _DDP_ARGUMENT_INSTEAD.get(name, default).format(role=role)
            raise TypeError(f"{strategy}: {name}= (DDP's constructor argument) is not accepted: {instead}")
        raise TypeError(
            f"{strategy}: unknown option {name}=; it takes replicate()'s options: {', '.join(known)} {also}"
        )
    checked = {name: value for name, value in options.items() if name in ReplicateConfig.__dataclass_fields__}
    if "ignored_modules" in checked:
        checked["ignored_modules"] = to_ignored_modules(checked["ignored_modules"])
    ReplicateConfig(**checked)  # raises replicate()'s own TypeError / ValueError
    return dict(options)


def refuse_replicated(module: nn.Module, strategy: str) -> None:
    """Refuses a module ``replicate()`` was already applied to (or one inside such a module).

    Every rank holds the same model, so every rank raises.

    Raises:
        RuntimeError: naming the module and the fix.
    """
    if find_state(module) is not None or enclosing_state(module) is not None:
        raise RuntimeError(
            f"{strategy}: this {type(module).__name__} is already replicated (replicate() was applied to it, "
            "or to a module holding it); pass the plain module: the strategy calls replicate() itself, "
            "with the options given to the strategy"
        )
