"""Every private torch entry point the library uses, in one place, and the torch releases it runs on.

Each entry point has no public equivalent; each was checked on the releases
of [Note: the torch range] below, with the torch versions it is known to
exist in. If a later torch moves one, this file is the only one to change.
Two reads stay inline on the gradient hook's hot path, where a call would
double its cost, each with a comment naming its function here:
``PROFILER._is_profiler_enabled`` and ``param._post_accumulate_grad_hooks``
(reducer/reducer.py). ``ReplansOnConversion`` overrides ``nn.Module._apply``,
the one method every conversion (``.to()``, ``.double()``) goes through
(core/plan.py).
"""

from __future__ import annotations

import atexit
import importlib
import sys
import types
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree  # tree_leaves, tree_map (torch >= 2.0): tensors_in, moved_to

# [Note: the torch range]
# The library runs on torch 2.9 to 2.14 (pyproject.toml says the same):
# scripts/torch_range.sh ran its core and DDP-comparison tests on 2.9.1,
# 2.11.0 (on Python 3.12), 2.13.0 (the development release) and 2.14.1
# (benchmarks/results/torch_range.json, at which commit). The floor: on 2.8.0,
# ProcessGroup.get_group_store is missing (FEATURES has the fallback), and
# fully_shard on a root whose child is replicated leaves the root's gradients
# wrong, for torch's own replicate as for ours (tests/test_nested.py): never
# silently wrong, so 2.8 is refused. On 2.6.0, 117 of 146 core tests failed.
# What differs inside the range is in FEATURES, by feature, each with what
# the library does without it; nothing else looks at torch's version.
FLOOR = (2, 9)
RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if RELEASE < FLOOR:
    raise ImportError(
        f"torchreplicate needs torch >= {FLOOR[0]}.{FLOOR[1]} (this is torch {torch.__version__}): "
        "its private entry points (torchreplicate/torch_internals.py) are checked from there on; "
        f"pip install 'torch>={FLOOR[0]}.{FLOOR[1]}'"
    )


class Feature(NamedTuple):
    """A torch capability the library probes for instead of assuming it (tests/test_torch_range.py)."""

    present: bool  # in the installed torch
    since: str  # the first release that has it
    without: str  # what the library does on a release without it


FEATURES: dict[str, Feature] = {
    "group_store": Feature(
        hasattr(dist.ProcessGroup, "get_group_store"),
        "2.9",
        "the stall watchdog reads the group's store from distributed_c10d's group map (the same store)",
    ),
    "profiler_flag": Feature(
        hasattr(torch.autograd.profiler, "_is_profiler_enabled"),
        "1.13",
        "the reducer records no torchreplicate:: labels in a torch.profiler trace, and trace() raises",
    ),
}


def group_store(group: Any) -> Any:
    """The store ``group`` was created with (a ``PrefixStore``), which its ranks share.

    ``ProcessGroup.get_group_store()`` (pybind, torch >= 2.9, missing from the
    stubs); on torch 2.8, ``distributed_c10d._world.pg_map[group][1]``, the
    same store as torch registers it (private; every release of the range).
    """
    if FEATURES["group_store"].present:
        return group.get_group_store()
    from torch.distributed import distributed_c10d

    return distributed_c10d._world.pg_map[group][1]


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Runs ``callback`` when the autograd graph task now executing ends.

    ``torch.autograd`` has no public way to run code once the current
    ``backward()`` has finished all its work; DDP and FSDP2 use the same
    entry point (``Variable._execution_engine.queue_callback``, since torch
    1.x). Must be called from inside a backward pass (from a tensor or
    gradient hook). Called from a nested backward (reentrant activation
    checkpointing), the callback runs when that nested pass ends, which is why
    the reducer queues it from a hook on the forward outputs, in the outermost
    pass (see [Note: end of backward] in core/state.py).
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class _NoProfilerFlag:
    _is_profiler_enabled = False  # a torch without the flag: labels are never recorded


# Whose ``_is_profiler_enabled`` tells whether a profiler records: torch's
# module (the flag torch keeps for exactly this fast Python check, set on start
# and stop by both ``torch.profiler.profile`` and the legacy profiler; torch >=
# 1.13), or a stand-in where a later torch drops it. The gradient hook reads
# ``PROFILER._is_profiler_enabled`` itself (one attribute read, on the hot path).
PROFILER: Any = torch.autograd.profiler if FEATURES["profiler_flag"].present else _NoProfilerFlag


def profiler_active() -> bool:
    """Whether a torch profiler session is recording (``PROFILER._is_profiler_enabled``)."""
    return PROFILER._is_profiler_enabled is True


def num_post_accumulate_grad_hooks(param: nn.Parameter) -> int:
    """How many post-accumulate-grad hooks ``param`` carries (``param._post_accumulate_grad_hooks``).

    torch has a public way to add such a hook, none to list them; the dict is
    where ``Tensor.register_post_accumulate_grad_hook`` puts them (torch >=
    2.2), None before the first. The reducer's gradient hook reads the same
    attribute inline (on the hot path, a function call would double its cost).
    """
    return len(param._post_accumulate_grad_hooks or ())


def in_backward_optimizers(param: nn.Parameter) -> tuple[torch.optim.Optimizer, ...]:
    """The optimizers torch's ``_apply_optimizer_in_backward`` attached to ``param`` (none: empty).

    torch keeps them in ``param._in_backward_optimizers`` (torch >= 2.0), where
    DDP reads them too; the reducer steps them once the average is in ``.grad``.
    """
    return tuple(getattr(param, "_in_backward_optimizers", ()))


def parameters_of(module: nn.Module) -> dict[str, Any]:
    """``module._parameters``, the dict ``nn.Module`` keeps its own parameters in (every torch).

    Writing it directly, not through ``setattr``, swaps a tensor in for one
    forward without running the global registration hooks ([Note:
    re-planning] in core/plan.py) or ``nn.Module``'s type checks; FSDP2 and
    ``torch.func.functional_call`` do the same.
    """
    return module._parameters


# [Note: no imports after init_process_group]
# Importing ``torch.distributed.optim`` runs its zero_redundancy_optimizer
# module, whose ``_broadcast_object(group=dist.group.WORLD)`` default is
# evaluated then (torch 2.0 to 2.13): imported after init_process_group(), it
# holds the world group for the life of the interpreter, so
# destroy_process_group() no longer frees it and gloo's threads and store
# connections meet the interpreter's teardown (issue 28: a rank aborted at exit
# with "terminate called without an active exception"). replicate() runs after
# init_process_group(), so it never imports that package: the in-backward
# optimizer map is read only where the user's code imported it (it must have,
# to apply one). Other torch modules do the same (torch.distributed.nn's
# collectives, fsdp's ShardedGradScaler: both imported with
# torch.distributed.fsdp, which this package imports), so a script that
# imports torchreplicate, or any of them, after init_process_group() holds the
# group the same way: ``release_destroyed_groups`` runs at interpreter exit
# (registered at import, so before the teardown) and drops such defaults where
# the group was destroyed, which frees it while the interpreter is whole.
# tests/test_exit.py checks both routes.
_IN_BACKWARD_MODULE = "torch.distributed.optim.apply_optimizer_in_backward"


def release_destroyed_groups() -> int:
    """Drops process groups that ``destroy_process_group()`` ended from torch's function defaults.

    See [Note: no imports after init_process_group]. Scans the functions and
    methods of the loaded ``torch.distributed`` modules; a default that is a
    ``ProcessGroup`` no longer in ``distributed_c10d._world.pg_map`` (private:
    torch >= 2.0, checked on 2.13) becomes None, torch's own "the default
    group". Returns how many functions it changed. Runs at exit; a live group
    (never destroyed) is left alone.
    """
    if not dist.is_available():
        return 0
    from torch.distributed import distributed_c10d

    live = distributed_c10d._world.pg_map

    def ended(value: object) -> bool:
        return isinstance(value, dist.ProcessGroup) and value not in live

    changed = 0
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not name.startswith("torch.distributed") or not isinstance(namespace, dict):
            continue
        for value in list(namespace.values()):
            # type(), not isinstance(): some module values warn when their __class__ is read
            is_class = issubclass(type(value), type) and vars(value).get("__module__") == name
            for function in list(vars(value).values()) if is_class else [value]:
                if type(function) is not types.FunctionType:
                    continue
                defaults, keywords = function.__defaults__ or (), function.__kwdefaults__ or {}
                if not any(map(ended, (*defaults, *keywords.values()))):
                    continue
                changed += 1
                if defaults:
                    function.__defaults__ = tuple(None if ended(v) else v for v in defaults)
                if keywords:
                    function.__kwdefaults__ = {k: None if ended(v) else v for k, v in keywords.items()}
    return changed


atexit.register(release_destroyed_groups)


def copy_into(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``destination.copy_(source)`` for each pair, in one call (``torch._foreach_copy_``, torch >= 2.1).

    What a batched bucket's launch runs ([Note: batched buckets] in reducer/bucket.py): torch's
    multi-tensor copy, the same bytes as one ``copy_`` per pair, at a third of the host time per
    tensor (0.51 against 0.89 us for 256 elements, measured on torch 2.13's CPU build). torch has
    no public multi-tensor copy; checked on 2.9.1, 2.11.0, 2.13.0 and 2.14.1.
    """
    torch._foreach_copy_(destinations, sources)


def remove_in_backward_optimizer_hooks(param: nn.Parameter) -> None:
    """Removes the hooks ``_apply_optimizer_in_backward`` put on ``param``'s gradient accumulator.

    Those hooks step the parameter's optimizers on the local gradient as soon
    as it is accumulated; the reducer steps them itself once the gradient is
    averaged. DDP does the same (``_setup_in_backward_optimizers``), reading
    the same map (torch >= 2.0). The optimizers stay in
    ``param._in_backward_optimizers``, where torch put them.
    """
    hooks = getattr(sys.modules.get(_IN_BACKWARD_MODULE), "param_to_optim_hook_handle_map", {})
    for handle in hooks.pop(param, []):
        handle.remove()


def claimed_elsewhere() -> tuple[int, int]:
    """What other torch APIs claimed, process-wide: parameters under optimizer-in-backward, composable states.

    Both move when a re-plan may be due ([Note: re-planning] in core/plan.py); one call at every forward.
    Two cheap stamps:

    - how many parameters torch's ``_apply_optimizer_in_backward`` has claimed:
      the length of ``torch.distributed.optim.apply_optimizer_in_backward.
      param_to_optim_hook_handle_map`` (present since torch 2.0), which moves
      when optimizer-in-backward is applied to any parameter. Read only where
      the user's code imported that module: see [Note: no imports after
      init_process_group].
    - how many modules hold a composable-API state (``fully_shard``, ...): the
      length of ``torch.distributed._composable_state._module_state_mapping``
      (torch >= 2.0), which moves when ``fully_shard`` is applied anywhere.
      ``fully_shard`` swaps parameters in without the module registration
      hooks, so this is how a replicated module notices it.
    """
    from torch.distributed import _composable_state

    module = sys.modules.get(_IN_BACKWARD_MODULE)
    return len(getattr(module, "param_to_optim_hook_handle_map", ())), len(_composable_state._module_state_mapping)


def fully_sharded_modules() -> list[nn.Module]:
    """Every live module that ``fully_shard`` was applied to (torch >= 2.6)."""
    from torch.distributed import _composable_state

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [module for module in list(_composable_state._module_state_mapping) if isinstance(module, FSDPModule)]


def composable_api(state_cls: type, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` under torch's ``@contract(state_cls)``: the registry of composable APIs.

    ``torch.distributed._composable.contract`` (private; torch >= 2.0,
    checked on 2.13) is the decorator torch's own ``replicate`` and
    ``fully_shard`` are registered with: a call records ``function.__name__``
    in the module's registry (``fully_shard`` skips modules whose registry
    holds ``"replicate"``) and a fresh ``state_cls()`` under ``function``,
    refuses a second call on one module (``AssertionError``), and checks that
    ``function`` left the names of parameters, buffers and submodules as they
    were (``RuntimeError``). See [Note: the registry] in core/registry.py.
    """
    from torch.distributed._composable.contract import contract

    return contract(state_cls)(function)


# ``importlib``, not ``from ... import``: the contract module, not the function of the same name that the
# package re-exports over it.
_CONTRACT_MODULE = "torch.distributed._composable.contract"


def composable_state(module: object, function: Callable[..., Any]) -> Any:
    """The state ``composable_api`` keeps for ``function`` on ``module``, or None; writes nothing.

    Read from the module's ``__dict__`` under the contract's ``STATE_KEY``
    (torch 2.13), not with the contract's own ``.state(module)``, which
    stores an empty registry in every module it is asked about.
    """
    states = getattr(module, "__dict__", {}).get(importlib.import_module(_CONTRACT_MODULE).STATE_KEY)
    return states.get(function) if isinstance(states, dict) else None


def without_composable_api(namespace: dict[str, Any], function: Callable[..., Any]) -> dict[str, Any]:
    """A copy of a module's ``__dict__`` without ``function``'s entries in the contract's registry.

    Other APIs' entries stay. The contract's two dicts (``STATE_KEY``,
    ``REGISTRY_KEY``; torch 2.13) are copied, not changed: ``namespace``
    itself is left as it was. What a copy or a pickle of a replicated module
    holds, and what a ``replicate()`` that failed part-way leaves.
    """
    contract = importlib.import_module(_CONTRACT_MODULE)
    copied = dict(namespace)
    for key, entry in ((contract.STATE_KEY, function), (contract.REGISTRY_KEY, function.__name__)):
        held = namespace.get(key)
        if isinstance(held, dict) and entry in held:
            copied[key] = type(held)((k, v) for k, v in held.items() if k != entry)
    return copied


def disable_join(joinable: object) -> None:
    """Gives ``joinable`` torch's disabled join config (what ``Joinable.__init__`` sets).

    A replicated module is a ``Joinable`` by registration only: its class is
    swapped in place, so no ``Joinable.__init__`` ever ran, and calling it
    now would fail (it calls ``super().__init__()``). ``_JoinConfig`` is
    private (torch >= 1.10); ``Join`` replaces it when entered.
    """
    from torch.distributed.algorithms.join import _JoinConfig

    joinable._join_config = _JoinConfig.construct_disabled_join_config()  # type: ignore[attr-defined]


def join_enabled(joinable: object) -> bool:
    """Whether torch's ``Join`` context is entered and enabled for ``joinable`` (its ``_join_config``).

    ``Join`` sets the private ``_join_config`` on each joinable (torch >= 1.10)
    and nothing else tells a joinable it is inside one.
    """
    config = getattr(joinable, "_join_config", None)
    return config is not None and bool(config.enable)


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward (a forward recomputed by a checkpoint, a hook).

    ``torch._C._current_graph_task_id()`` is -1 outside one (torch >= 2.1), not a public API.
    """
    return torch._C._current_graph_task_id() != -1


def compiled_autograd_enabled() -> bool:
    """Whether ``torch._dynamo.config.compiled_autograd`` is on (False while dynamo was never imported).

    A config flag of torch's compiler (torch >= 2.4), not a public API.
    """
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and bool(getattr(dynamo.config, "compiled_autograd", False))


def keep_device_busy(device: torch.device, seconds: float = 1e-3) -> None:
    """Queues about ``seconds`` of idle work on ``device``'s current stream (CUDA only), so that events
    recorded after it run once the host has enqueued what follows them (a timed sample is the device's).

    ``torch.cuda._sleep(cycles)`` (private, present from torch 1.x to 2.15): at 2 GHz, 2e6 cycles a ms;
    a faster clock makes the wait shorter, which the host's enqueue (tens of microseconds) still fits.
    """
    with torch.cuda.device(device):
        torch.cuda._sleep(int(seconds * 2e9))


def swap_ddp_fusion(values: tuple[bool, float]) -> tuple[bool, float]:
    """Sets inductor's ``_fuse_ddp_communication`` and ``_fuse_ddp_bucket_size`` (MB); returns what they held.

    With them on, inductor fuses the all-reduces of DDP's Python reducer (a
    gradient divided, all-reduced by a functional collective, copied back:
    the same nodes as ours under compiled autograd) into buckets of that
    size (torch/_inductor/fx_passes/ddp_fusion.py). DDP turns them on at
    construction under compiled autograd. Private config of torch's compiler,
    the same on 2.8.0, 2.9.1, 2.11.0, 2.13.0, 2.14.1 and 2.15.0.
    """
    from torch._inductor import config

    previous = (bool(config._fuse_ddp_communication), float(config._fuse_ddp_bucket_size))
    config._fuse_ddp_communication, config._fuse_ddp_bucket_size = values  # type: ignore[assignment]
    return previous


def traced_all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """A sum over the group that compiled autograd can trace into its graph.

    ``torch.distributed._functional_collectives.all_reduce`` (torch >= 2.1;
    no public name in 2.13) returns a new tensor and needs no work handle:
    what DDP's Python reducer uses under compiled autograd.
    """
    from torch.distributed import _functional_collectives

    group: Any = group_name  # a GroupName (a str) for torch's stubs
    summed: torch.Tensor = _functional_collectives.all_reduce(tensor, "sum", group)
    return summed


def group_timeout(group: Any) -> float:
    """Seconds a collective of ``group`` may wait before its backend ends it (``init_process_group(timeout=)``).

    torch has no public getter; the backend's options hold it
    (``group._get_backend(device).options._timeout``, gloo and NCCL, checked
    on torch 2.13). Where that is missing: torch's public default for the
    backend (``dist.default_pg_timeout``, 30 minutes).
    """
    try:
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        return float(group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return float(dist.default_pg_timeout.total_seconds())


def preserved_versions(tensors: Sequence[torch.Tensor]) -> Any:
    """A context in which in-place writes to ``tensors`` leave their autograd version counters as they were.

    ``torch.autograd._unsafe_preserve_version_counter`` (torch >= 2.1, no
    public equivalent; checked on 2.13): what DDP's ``_sync_buffers`` wraps
    its in-place buffer broadcast in. Why it is safe for the buffer
    broadcast, and where it is not: [Note: buffer sync] in core/buffers.py.
    """
    return torch.autograd._unsafe_preserve_version_counter(tuple(tensors))


def version_of(tensor: torch.Tensor) -> int:
    """``tensor._version``: autograd's count of in-place writes to it (every torch; no public name), which
    tells a buffer changed since the staging of rank 0's values (core/buffers.py's ``StagedBuffers``)."""
    return int(tensor._version)


def active_ddp_module() -> Any:
    """The ``DistributedDataParallel`` whose forward is running now, or None.

    DDP's forward sets the class attribute ``_active_ddp_module`` around the
    wrapped module's forward (``_inside_ddp_forward``, torch >= 2.0, checked
    on 2.13; it is what torch's compiler reads). A replicated module's
    forward hook reads it to notice DDP on top of it: every gradient would
    be averaged twice. DDP's python-reducer mode (compiled autograd) does not
    set it, and is not noticed.
    """
    active = getattr(DistributedDataParallel, "_active_ddp_module", None)
    return active if isinstance(active, DistributedDataParallel) else None  # not ours (swap_active_ddp_module)


def swap_active_ddp_module(value: Any) -> tuple[Any, Any, bool]:
    """Sets DDP's class attribute ``_active_ddp_module`` to ``value``; returns what it held, the
    ``DistributedDataParallel`` among it (``active_ddp_module``: DDP on top of a replicated module), and
    whether compiled autograd is on: what a replicated module's forward reads of torch's compiler.

    torch's compiler reads the attribute when it converts a frame: where it is set and
    ``torch._dynamo.config.optimize_ddp`` is on (the default), dynamo's
    ``DDPOptimizer`` splits the frame's graph at buckets of
    ``value.bucket_bytes_cap`` bytes, the only attribute it reads
    (torch/_dynamo/convert_frame.py; the same on 2.8.0, 2.9.1, 2.11.0,
    2.13.0, 2.14.1 and 2.15.0). torch's composable ``replicate`` sets it
    around its forward the same way ([Note: compiled backward split at
    bucket boundaries] in core/compile_split.py).
    """
    previous = active_ddp_module()
    held = getattr(DistributedDataParallel, "_active_ddp_module", None)
    DistributedDataParallel._active_ddp_module = value
    return held, previous, compiled_autograd_enabled()


def ddp_reduces_any(ddp: Any, params: Sequence[torch.Tensor]) -> bool:
    """Whether ``ddp`` (a ``DistributedDataParallel``) reduces any of ``params``: those its module holds
    that its ``parameters_to_ignore`` (names, DDP's attribute) does not name. A replicated module run
    by DDP would have those gradients averaged twice."""
    ignored = getattr(ddp, "parameters_to_ignore", ())
    reduced = {id(p) for name, p in ddp.module.named_parameters() if name not in ignored}
    return any(id(p) in reduced for p in params)


def tensors_in(value: Any) -> list[Any]:
    """The leaves of a forward's output (lists, tuples, dicts, named tuples and the containers
    libraries register, such as transformers' ``ModelOutput``): ``torch.utils._pytree.tree_leaves``
    (torch >= 2.0, checked on 2.13), what torch's own DDP and FSDP2 walk outputs with."""
    return _pytree.tree_leaves(value)


def moved_to(device: torch.device, value: Any) -> Any:
    """``value`` with every tensor in it moved to ``device`` (``torch.utils._pytree.tree_map``, torch >= 2.0,
    checked on 2.13): what DDP's ``device_ids`` does to a forward's inputs."""
    return _pytree.tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, value)
