"""What torch's own ``replicate`` (the seed) and DDP's constructor say when they refuse.

[Note: the seed's contract] Where the seed (``torch/distributed/_composable/
replicate.py``, which builds a ``DistributedDataParallel`` at the first
forward) refuses an input that ``replicate()`` refuses too, ours raises an
exception of the seed's type and puts the seed's (or DDP's) message first, our
clearer text after it, so code and tests that catch the seed's exception or
match its text keep working. Where the seed's type and ours differ, the
exception class here subclasses both. The texts are checked against torch
2.13 by tests/test_seed_contract.py, which runs the seed beside ours.
"""

from __future__ import annotations

from typing import Any


class DeviceIdError(TypeError, ValueError, RuntimeError):
    """A bad ``device_id``: a ``TypeError``/``ValueError`` (ours) and a ``RuntimeError`` (the seed's).

    The seed raises ``RuntimeError`` for a ``device_id`` that is neither an
    ``int`` nor a ``torch.device``, and DDP ``ValueError`` for an index it
    cannot use; ours raises this, which is all three.
    """


class AlreadyReplicatedError(RuntimeError, AssertionError):
    """``replicate()`` applied twice to one module: the seed's ``AssertionError`` and ours' ``RuntimeError``."""


class GroupOptionError(ValueError, RuntimeError):
    """Conflicting or malformed group options: ours' ``ValueError`` and DDP's ``RuntimeError``."""


def seed_device_id_text(device_id: object) -> str:
    """The seed's message for a ``device_id`` that is neither an int nor a torch.device.

    Args:
        device_id: the value given.
    """
    return f"Expected device_id to be int or torch.device, but got {type(device_id)}"


def seed_applied_twice_text(module: object) -> str:
    """The seed's (its ``contract`` decorator's) message for a second ``replicate()`` on one module.

    Args:
        module: the module, printed as the seed prints it.
    """
    return (
        "Each distinct composable distributed API can only be applied to a module once. "
        f"replicate has already been applied to the following module:\n{module}"
    )


def not_iterable_text(value: object) -> str:
    """Python's message for iterating a non-iterable, which the seed raises for a bad ``ignored_modules``.

    Args:
        value: the value given.
    """
    return f"{type(value).__name__!r} object is not iterable"


DDP_BOTH_GROUPS_TEXT = "Cannot specify both process_group and device_mesh arguments."
DDP_ONE_DEVICE_TEXT = "device_ids can only be None or contain a single element."
DDP_DELAY_PAIR_TEXT = "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time."


def ddp_mesh_dims_text(mesh: Any) -> str:
    """DDP's message for a ``device_mesh`` that is not 1-D.

    Args:
        mesh: the ``DeviceMesh`` given.
    """
    return f"Only 1D device mesh is supported, but got {mesh}."


def ddp_device_types_text(device_types: set[str]) -> str:
    """DDP's message for a module whose parameters lie on more than one device type.

    Args:
        device_types: the device types, e.g. ``{"cpu", "meta"}``.
    """
    return (
        "DistributedDataParallel's input module must be on the same type of devices, "
        f"but input module parameters locate in {device_types}."
    )
