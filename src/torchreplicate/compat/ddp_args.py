"""DDP's constructor arguments in ``replicate()``'s terms, and what ``replicate()`` refuses of a module.

Code written against ``DistributedDataParallel``, or against torch's own
``replicate`` (which passes its keyword arguments through to DDP), calls
``replicate(model, device_ids=[local_rank], output_device=local_rank, ...)``.
Every argument of DDP 2.13's signature is accepted here with DDP's meaning,
mapped onto ours, or refused with the reason and what to write instead
(the table is in docs/migration.md; the README has the short one). A model wrapped in DDP, or one
already replicated, is refused here too, with the seed's message first where the seed refuses
it. Refusals happen before any collective, so every rank raises the same error.
"""

from __future__ import annotations

import difflib
import warnings
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from torchreplicate.config import resolve_group, to_device
from torchreplicate.core.nested import class_name, is_fully_sharded, refuse_inside_fully_shard
from torchreplicate.core.registry import enclosing_state, find_state
from torchreplicate.errors import (
    DDP_DELAY_PAIR_TEXT,
    DDP_ONE_DEVICE_TEXT,
    AlreadyReplicatedError,
    ddp_device_types_text,
    seed_applied_twice_text,
)

# DDP's constructor (2.13's, then 2.15's lazy_bucket_allocation), after `module`, in order; replicate() has the other
# names of its signature itself (process_group, bucket_cap_mb, ...).
DDP_POSITIONAL_ORDER = (
    "device_ids",
    "output_device",
    "dim",
    "broadcast_buffers",
    "init_sync",
    "process_group",
    "bucket_cap_mb",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
    "delay_all_reduce_named_params",
    "param_to_hook_all_reduce",
    "mixed_precision",
    "device_mesh",
    "skip_all_reduce_unused_params",
    "bucket_cap_mb_list",
    "batched_grad_copy",
    "forward_sync_buffers",
    "lazy_bucket_allocation",  # DDP 2.15's
)

_CALLER = 4  # warnings point at replicate()'s caller: warn_no_effect, ddp_options, replicate, caller


def warn_no_effect(option: str, value: Any, why: str, *, stacklevel: int = 3) -> None:
    """Warns that a DDP option is accepted for compatibility but changes nothing.

    Args:
        option: the option's name.
        value: the value given.
        why: why it changes nothing.
        stacklevel: as ``warnings.warn``'s, counted from here. Default 3: the
            caller of the function that calls this one.
    """
    warnings.warn(f"replicate(): {option}={value!r} has no effect: {why}", UserWarning, stacklevel=stacklevel)


def refuse_positional(positional: tuple[Any, ...]) -> None:
    """Refuses options given by position, naming the keyword each one should be.

    DDP's second positional argument is ``device_ids``, the seed's is
    ``ignored_modules``: a positional call is ambiguous, so replicate()'s
    options are keyword-only.

    Raises:
        TypeError: naming, for each value, the keyword to write.
    """
    if not positional:
        return
    fixes = ", ".join(f"{_keyword_for(value)}={_short(value)}" for value in positional)
    raise TypeError(
        f"replicate() takes 1 positional argument but {1 + len(positional)} were given: its options are "
        "keyword-only (DDP's positional order and torch's replicate's differ), so write them by name, "
        f"e.g. replicate(model, {fixes})"
    )


def _keyword_for(value: object) -> str:
    # The keyword a positional value most likely meant.
    if isinstance(value, dist.ProcessGroup):
        return "process_group"
    if type(value).__name__ == "DeviceMesh":
        return "device_mesh"
    if isinstance(value, (list, tuple, set)) and value and all(isinstance(v, nn.Module) for v in value):
        return "ignored_modules"
    if isinstance(value, (list, tuple)):
        return "device_ids"
    if isinstance(value, (int, torch.device)) and not isinstance(value, bool):
        return "device_id"
    return "<option>"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"<{type(value).__name__}>"


def _refuse_model(module: object) -> None:
    # What replicate() is not applied to: not a module, a list, a DDP-wrapped model (or one holding a DDP),
    # a module inside a replicated one, a module fully_shard manages.
    if isinstance(module, (list, tuple)):
        raise TypeError(
            "replicate(): expected one nn.Module, got a list; to reduce several blocks as units, "
            "replicate each block and then their common parent (nested replicate: one collective "
            "sequence, buckets that follow the blocks)"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"replicate(): expected an nn.Module, got {type(module).__name__}")
    if isinstance(module, DistributedDataParallel):
        raise TypeError(
            "replicate(): got a torch.nn.parallel.DistributedDataParallel (wrapping "
            f"{class_name(module.module)}): DDP already averages its gradients, and replicate() would "
            "average them again. Pass the model itself: replicate(model), not replicate(DDP(model)) "
            "(with DDP's options as keywords: replicate(model, device_ids=..., bucket_cap_mb=...))"
        )
    for name, inner in module.named_modules():
        if isinstance(inner, DistributedDataParallel):
            raise RuntimeError(
                f"replicate(): the submodule {name!r} is a torch.nn.parallel.DistributedDataParallel: DDP "
                "already averages its gradients, and replicate() would average them again. Keep its "
                f"module instead (model.{name} = model.{name}.module) before replicate(model)"
            )
    if find_state(module) is not None:
        raise AlreadyReplicatedError(
            f"{seed_applied_twice_text(module)}\nreplicate(): replicate() was already applied to this "
            f"{type(module).__name__}: applying it twice is not supported; call it once on the root module"
        )
    if (outer := enclosing_state(module)) is not None:
        raise RuntimeError(
            f"replicate(): this {type(module).__name__} is inside {class_name(outer.module)}, which "
            "replicate() was already applied to; apply replicate() to the blocks first, then to the "
            "enclosing module (nested replicate, as torchtitan does)"
        )
    if is_fully_sharded(module):
        raise RuntimeError(
            "Cannot apply `replicate()` on a Module already managed by `fully_shard` replicate(): "
            f"this {type(module).__name__} is sharded by fully_shard; replicate its parent instead "
            "(submodules that fully_shard manages are skipped), or use fully_shard alone"
        )
    refuse_inside_fully_shard(module)


def ddp_options(
    module: nn.Module, positional: tuple[Any, ...], arguments: Mapping[str, Any], own_names: Sequence[str], **own: Any
) -> dict[str, Any]:
    """What ``replicate()`` refuses before its options are checked, then DDP's keyword arguments applied to them.

    Refuses options given by position (``refuse_positional``) and what
    ``replicate()`` is not applied to (a list, a DDP-wrapped model, a module
    already replicated or inside one, one that ``fully_shard`` manages), then
    applies DDP's keyword arguments to replicate()'s own options, with DDP's meaning.

    Args:
        module: the model (some arguments are checked against its device).
        positional: the arguments given to ``replicate()`` by position after the model.
        arguments: the DDP-only keyword arguments given to ``replicate()``.
        own_names: replicate()'s own keyword names (its signature), for "did you mean".
        **own: replicate()'s own values of ``device_id``,
            ``broadcast_buffers`` and ``bucket_cap_mb``.

    Returns:
        ``own`` updated, with ``init_sync`` and DDP's ``dim`` added and
        ``broadcast_buffers`` and ``init_sync_buffers`` resolved (None: True,
        and as ``broadcast_buffers``).

    Raises:
        TypeError: an option given by position (naming its keyword), not one
            module, or a name DDP does not have either (Python's message first).
        RuntimeError: a module replicate() is not applied to (the seed's message first where it refuses too).
        ValueError: a DDP argument replicate() cannot honour: why, and what
            to write instead (DDP's own message first where DDP refuses too).
    """
    refuse_positional(positional)
    _refuse_model(module)
    if unknown := sorted(set(arguments) - set(DDP_POSITIONAL_ORDER)):
        close = difflib.get_close_matches(unknown[0], [*own_names, *DDP_POSITIONAL_ORDER], n=1)
        hint = f"; did you mean {close[0]}=?" if close else ""
        raise TypeError(f"replicate() got an unexpected keyword argument {unknown[0]!r}{hint}")
    if (arguments.get("delay_all_reduce_named_params") is None) != (arguments.get("param_to_hook_all_reduce") is None):
        raise ValueError(
            f"{DDP_DELAY_PAIR_TEXT} replicate(): both are accepted and change nothing (every parameter is "
            "averaged in bucket order), so the simplest fix is to drop both"
        )
    options = {**own, "init_sync": True, "init_sync_buffers": None, "dim": 0}
    for name in DDP_POSITIONAL_ORDER:
        if name not in arguments:
            continue
        value = arguments[name]
        if name in NO_EFFECT and value not in (None, False, 0):
            shown = "[...]" if name == "delay_all_reduce_named_params" else value
            warn_no_effect(name, shown, NO_EFFECT[name], stacklevel=_CALLER)
        if name in _HANDLERS:
            _HANDLERS[name](value, options, module)
    broadcast = True if options["broadcast_buffers"] is None else options["broadcast_buffers"]
    init_sync_buffers = broadcast if options["init_sync_buffers"] is None else options["init_sync_buffers"]
    return {**options, "broadcast_buffers": broadcast, "init_sync_buffers": init_sync_buffers}


def _device_ids(value: Any, options: dict[str, Any], module: nn.Module) -> None:
    # DDP: the one device this process's module lives on -> device_id.
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"replicate(): device_ids must be a list of one device (DDP's spelling), got {value!r}; "
            f"write device_ids=[{value!r}] or device_id={value!r}"
        )
    if len(value) > 1:
        raise ValueError(
            f"{DDP_ONE_DEVICE_TEXT} replicate(): one process per device, got device_ids={list(value)}; "
            "pass device_ids=[local_rank] (or device_id=local_rank) and start one process per device (torchrun)"
        )
    given = options["device_id"]
    if given is not None and to_device(given) != to_device(value[0]):
        raise ValueError(
            f"replicate(): device_ids={list(value)} and device_id={given!r} name different devices; "
            "pass one of them (device_id is replicate()'s spelling)"
        )
    options["device_id"] = value[0]


def _output_device(value: Any, options: dict[str, Any], module: nn.Module) -> None:
    # DDP (one device per process) returns outputs where the module computes
    # them: output_device only names that device. Accepted when it does.
    if value is None:
        return
    wanted = to_device(value)
    device = to_device(options["device_id"]) or _module_device(module)
    if wanted is not None and not _same_device(wanted, device):
        raise ValueError(
            f"replicate(): output_device={value!r} ({wanted}) but the module computes on {device}; outputs "
            "come back on the module's device (as DDP's, which moves them only in the multi-device mode it "
            f"no longer supports). Drop output_device, or move them yourself: output.to({str(wanted)!r})"
        )


def _module_device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _dim(value: Any, options: dict[str, Any], module: nn.Module) -> None:
    options["dim"] = value  # what model.dim answers (compat/ddp_surface.py); warned about in ddp_options


def _init_sync(value: Any, options: dict[str, Any], module: nn.Module) -> None:
    # DDP: False skips the broadcast of parameters and buffers (the caller
    # vouches that they are equal). Ours keeps each rank's own values instead.
    if not isinstance(value, bool):
        raise TypeError(f"replicate(): init_sync must be True or False, got {value!r}")
    options["init_sync"] = value


def _mixed_precision(value: Any, options: dict[str, Any], module: nn.Module) -> None:
    if value is None:
        return
    fields = [f"{n}={v}" for n in ("param_dtype", "reduce_dtype") if (v := getattr(value, n, None)) is not None]
    raise ValueError(
        "replicate(): mixed_precision (DDP's private _MixedPrecision) is not supported; pass torch's "
        f"public policy instead: mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy({', '.join(fields)}) "
        "(fp32 master weights, compute in param_dtype, reduce in reduce_dtype; buffers stay in their dtype)"
    )


def _bucket_cap_mb_list(value: Any, options: dict[str, Any], module: nn.Module) -> None:
    # DDP: one cap per bucket, in DDP's bucket order. One cap for all maps exactly.
    if not value:
        return
    if len(value) == 1 and options["bucket_cap_mb"] is None:
        options["bucket_cap_mb"] = value[0]
        return
    raise ValueError(
        f"replicate(): bucket_cap_mb_list={list(value)} (a cap per bucket) is not supported; pass "
        "bucket_cap_mb= for every bucket and first_bucket_cap_mb= for the first, or leave both to "
        'the tuner (bucket_layout="tuned" measures the link)'
    )


def _forward_sync_buffers(value: Any, options: dict[str, Any], module: nn.Module) -> None:
    # DDP 2.13's new name for broadcasting buffers before each forward. Unlike
    # broadcast_buffers=False, forward_sync_buffers=False keeps the broadcast
    # at set-up, in DDP as here ([Note: buffer sync] in core/buffers.py).
    if value is None:
        return
    if not isinstance(value, bool):
        raise TypeError(f"replicate(): forward_sync_buffers must be True, False or None, got {value!r}")
    options["init_sync_buffers"] = True
    if options["broadcast_buffers"] is not None:
        warnings.warn(
            "replicate(): both broadcast_buffers and forward_sync_buffers were given; forward_sync_buffers "
            "wins (as in DDP)",
            FutureWarning,
            stacklevel=_CALLER,
        )
    options["broadcast_buffers"] = value


# DDP's arguments accepted for DDP call sites that change nothing here, and why: a warning where one is set
# (not None, False or 0). param_to_hook_all_reduce is warned about with delay_all_reduce_named_params, its
# pair (checked together in ddp_options).
NO_EFFECT: Mapping[str, str] = MappingProxyType(
    {
        "dim": (
            "DDP scatters inputs along dim only in the single-process multi-device mode it no longer "
            "supports; each rank's forward gets its own inputs unchanged, in DDP as here"
        ),
        "check_reduction": "DDP deprecated it and ignores it",
        "delay_all_reduce_named_params": (
            "DDP only postpones these parameters' averaging to one all-reduce when another gradient is "
            "ready; here they are averaged with the rest, in bucket order, to the same result"
        ),
        "skip_all_reduce_unused_params": (
            "DDP skips reducing parameters unused on every rank; the averages are the same here"
        ),
        "batched_grad_copy": (
            "gradients are views into their buckets (gradient_as_bucket_view), or copied one bucket at a time"
        ),
        "lazy_bucket_allocation": (
            "DDP 2.15 allocates its buckets during backward and frees them after; here they stay allocated "
            "(at the default gradient_as_bucket_view, every .grad is a view into them), to the same results"
        ),
    }
)

_HANDLERS: dict[str, Callable[[Any, dict[str, Any], nn.Module], None]] = {
    "device_ids": _device_ids,
    "output_device": _output_device,
    "dim": _dim,
    "init_sync": _init_sync,
    "mixed_precision": _mixed_precision,
    "bucket_cap_mb_list": _bucket_cap_mb_list,
    "forward_sync_buffers": _forward_sync_buffers,
}


def refuse_module(module: nn.Module, ignored: tuple[nn.Module, ...], device_id: Optional[object]) -> None:
    """DDP's refusals of the module itself, with DDP's type and message first.

    Args:
        module: the model.
        ignored: the ignored modules (their parameters are not checked).
        device_id: replicate()'s ``device_id``; when given, the module is
            moved there first, so its parameters' devices do not matter.

    DDP also refuses uninitialized (``Lazy``) parameters; ours takes them in
    at their first forward (core/lazy.py), so they are not checked here.

    Raises:
        ValueError: parameters on more than one device type, no ``device_id``.
    """
    skipped = {id(p) for m in ignored for p in m.parameters()}
    uninitialized = nn.parameter.UninitializedParameter
    device_types = {
        p.device.type for p in module.parameters() if id(p) not in skipped and not isinstance(p, uninitialized)
    }
    if device_id is None and len(device_types) > 1:
        raise ValueError(
            f"{ddp_device_types_text(device_types)} replicate(): move the whole model to one device first "
            "(model.to(device)), or pass device_id= to have replicate() move it"
        )


def group_of(
    process_group: Optional[dist.ProcessGroup], mesh: Optional[DeviceMesh], device_mesh: Optional[DeviceMesh]
) -> Optional[dist.ProcessGroup]:
    """The group to average over: ``process_group=``, or the group of a mesh under either name (``device_mesh``: DDP's).

    Raises:
        ValueError: both ``mesh=`` and ``device_mesh=``.
        TypeError / GroupOptionError: as ``config.resolve_group``'s.
    """
    if mesh is not None and device_mesh is not None:
        raise ValueError("replicate(): pass mesh= or device_mesh= (DDP's name for it), not both")
    return resolve_group(
        process_group, mesh if device_mesh is None else device_mesh, "mesh" if device_mesh is None else "device_mesh"
    )
