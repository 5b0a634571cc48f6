"""DDP's attributes and methods on a replicated module: each behaves as DDP's, or says what to use.

Code written for ``DistributedDataParallel`` (nanoGPT, Lightning, accelerate,
torchrec) reads and sets attributes of the wrapper and calls its methods.
``ReplicateModule`` derives from ``DDPSurface``, so a replicated module
answers each of them as DDP 2.13 does on the same job, or raises naming the
replacement; none is ignored in silence. The table is in docs/migration.md
("DDP's attributes and methods").

[Note: the model's own names win]
DDP's names are common words (``dim``, ``device_type``, ``gather``), and a
model may have an attribute, parameter, buffer, submodule or method of its
own under one of them: the model's wins, as for ``module``. A class-level
definition is kept by api.py's replicated class (``OWN_NAMES_WIN``); an
instance attribute or registered tensor or module is looked up first by
``_DDPAttribute``, and the methods below are plain methods, which an
instance attribute shadows anyway.
"""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from torchreplicate.compat.ddp_args import warn_no_effect
from torchreplicate.compat.view import view_of
from torchreplicate.config import DDP_DEFAULT_CAP_MB, MiB
from torchreplicate.core.join import start_join
from torchreplicate.core.plan import IGNORE_ATTRIBUTE, check_ignored_names
from torchreplicate.core.registry import get_state

if TYPE_CHECKING:
    from torchreplicate.core.state import ReplicateState


_STORES = ("_parameters", "_buffers", "_modules")
_ABSENT = object()


def _own(module: object, name: str) -> Any:
    # The model's own value under `name` (an attribute, parameter, buffer or submodule), or _ABSENT.
    attributes = vars(module)
    if name in attributes:
        return attributes[name]
    for store in _STORES:
        values = attributes.get(store)
        if values is not None and name in values:
            return values[name]
    return _ABSENT


class _TheModel:
    # `model.module`: the model seen as DDP's inner module ([Note: model.module] in
    # compat/view.py), unless it has a parameter, buffer or submodule of that name.
    # Not a data descriptor, so an instance attribute `module` wins too (and setting
    # one is a plain assignment); state_dict keys are untouched.
    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        own = _own(obj, "module")
        return view_of(obj) if own is _ABSENT else own


class _DDPAttribute:
    # One of DDP's attributes ([Note: the model's own names win]). `read` answers
    # from the state; `write` (None: read-only) applies a new value; `instead`
    # says what to do when a read-only one is set.
    def __init__(
        self,
        read: Callable[[ReplicateState], Any],
        write: Optional[Callable[[ReplicateState, Any], None]] = None,
        instead: str = "",
    ) -> None:
        self.read, self.write, self.instead = read, write, instead
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        own = _own(obj, self.name)
        return self.read(get_state(obj)) if own is _ABSENT else own

    def __set__(self, obj: Any, value: Any) -> None:
        if self.name in vars(obj):
            vars(obj)[self.name] = value  # the model's own attribute
        elif self.write is not None:
            self.write(get_state(obj), value)
        else:
            raise AttributeError(
                f"replicate(): {self.name} is DDP's attribute, read-only on a replicated module: {self.instead}"
            )


def _switch(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"replicate(): {name} must be True or False, got {value!r}")
    return value


def _set_before_forward(state: ReplicateState, value: Any) -> None:
    state.buffer_sync.before_forward = _switch("broadcast_buffers (forward_sync_buffers)", value)


def _set_due(state: ReplicateState, value: Any) -> None:
    state.buffer_sync.set_due(_switch("require_forward_param_sync", value))


def _device_index(state: ReplicateState) -> Optional[int]:
    # DDP keeps device_ids / output_device for a module on one accelerator it was given; None on the CPU.
    device = state.config.device_id
    if device is None or device.type == "cpu":
        return None
    return device.index if device.index is not None else torch.accelerator.current_device_index()


def _bucket_bytes_cap(state: ReplicateState) -> int:
    if state.reducer is not None:
        return int(state.reducer.layout_policy.cap_bytes)  # the tuned cap once measured
    cap = state.config.cap_bytes
    return DDP_DEFAULT_CAP_MB * MiB if cap is None else cap  # tuned: DDP's until the first step measured the link


def _device_type(state: ReplicateState) -> str:
    return next((param.device.type for param in state.plan.candidates), state.device.type)


def ignored_by_name(module: nn.Module, ignored_modules: tuple[nn.Module, ...]) -> frozenset[str]:
    """Names of the parameters and buffers ``module`` leaves alone: DDP's list and ``ignored_modules``."""
    names = set(check_ignored_names(getattr(module, IGNORE_ATTRIBUTE, ())))
    skipped = {id(t) for m in ignored_modules for t in (*m.parameters(), *m.buffers())}
    names |= {n for n, t in (*module.named_parameters(), *module.named_buffers()) if id(t) in skipped}
    return frozenset(names)


# -- DDP's configuration and internals -------------------------------------------
# The rest of DDP 2.13's public attributes (and its private built-in hook
# registration), kept apart from the surface above: each answers with DDP's
# meaning, read-only as DDP's configuration is, or raises an AttributeError
# saying why there is none here and what to use (docs/migration.md, "DDP's
# attributes and methods"; tests/test_ddp_attributes.py against DDP).

# DDP's attributes with nothing behind them here: why, and what to use instead.
NOT_HERE: Mapping[str, str] = MappingProxyType(
    {
        "reducer": (
            "DDP's C++ dist.Reducer; replicate() has its own reducer in Python, replicate.state(model).reducer, "
            "which is not a dist.Reducer: register comm hooks with model.register_comm_hook(state, hook)"
        ),
        "logger": (
            "DDP's C++ dist.Logger; model._get_ddp_logging_data() answers DDP's construction-time keys, and "
            "torchreplicate.trace(model) or log_summary(model) time every step"
        ),
        "to_kwargs": (
            "DDP's helper that copies the inputs to device_ids[0]; replicate() has no such helper, but moves a "
            "forward's tensor inputs as DDP does: to device_id where it is an accelerator (else they stay where "
            "the caller put them)"
        ),
        "use_side_stream_for_tensor_copies": (
            "DDP's switch (PYTORCH_DDP_USE_SIDE_STREAM) for copying inputs to the device; replicate() moves a "
            "forward's tensor inputs to an accelerator device_id on the current stream, with no switch"
        ),
        "broadcast_bucket_size": (
            "DDP's 250 MiB bucket for the set-up broadcast; replicate() broadcasts the parameters and buffers in "
            "the same 250 MiB pieces, with no size to set"
        ),
        "bucket_bytes_cap_list": (
            "DDP's caps per bucket (bucket_cap_mb_list); replicate() has one cap for every bucket but the first: "
            "model.bucket_bytes_cap, and first_bucket_cap_mb= for the first"
        ),
        "skip_all_reduce_unused_params": (
            "accepted by replicate() for DDP call sites and not kept: it changes nothing here (the averages are "
            "the same); unused parameters are always handled"
        ),
        "batched_grad_copy": (
            "accepted by replicate() for DDP call sites and not kept: it changes nothing here (gradients are "
            "views into their buckets, gradient_as_bucket_view=True, or copied one bucket at a time)"
        ),
    }
)


def _module_buffers(state: ReplicateState) -> list[tuple[str, torch.Tensor]]:
    # DDP's _assign_modules_buffers: every buffer not in parameters_to_ignore, by name, in module order.
    ignored = ignored_by_name(state.module, state.config.ignored_modules)
    return [(name, buffer) for name, buffer in state.module.named_buffers() if name not in ignored]


def _first_device(state: ReplicateState) -> torch.device:
    # DDP: the device of the first parameter it replicates.
    return next((param.device for param in state.params), state.device)


_READ_ONLY = "DDP's configuration, fixed at construction: {}"
_BUFFER_LIST = _READ_ONLY.format("it lists the module's buffers; register or replace buffers on the module")


class DDPInternals:
    """DDP's configuration attributes and internals, as a replicated module answers them.

    Attributes:
        device: the device of the first replicated parameter, as DDP's.
        mixed_precision: DDP's private ``_MixedPrecision`` config: always
            None here (``mixed_precision=`` is refused, naming ``mp_policy=``).
        modules_buffers: the buffers not in ``parameters_to_ignore``, in
            module order, as DDP's list (read now, so a reassigned buffer shows).
        named_module_buffers: the same, as a dict by fully qualified name.
        is_multi_device_module: whether the replicated parameters sit on
            more than one device.
        bucket_bytes_cap_default: whether the first bucket's cap is below the
            others' (DDP's definition: with its default caps; here also with
            a smaller ``first_bucket_cap_mb=`` given).

    DDP's ``reducer``, ``logger``, ``to_kwargs``, ``broadcast_bucket_size``,
    ``bucket_bytes_cap_list``, ``skip_all_reduce_unused_params``,
    ``batched_grad_copy`` and ``use_side_stream_for_tensor_copies`` raise
    ``AttributeError`` saying why there is none here and what to use
    (``NOT_HERE``).
    """

    device = _DDPAttribute(_first_device, instead=_READ_ONLY.format("move the model with model.to(device)"))
    mixed_precision = _DDPAttribute(
        lambda s: None, instead=_READ_ONLY.format("pass mp_policy=MixedPrecisionPolicy(...) to replicate()")
    )
    modules_buffers = _DDPAttribute(lambda s: [buffer for _, buffer in _module_buffers(s)], instead=_BUFFER_LIST)
    named_module_buffers = _DDPAttribute(lambda s: dict(_module_buffers(s)), instead=_BUFFER_LIST)
    is_multi_device_module = _DDPAttribute(
        lambda s: len({p.device for p in s.params}) > 1, instead=_READ_ONLY.format("it follows the parameters")
    )
    # DDP's definition: the first bucket's cap is below the others' (in DDP, only with its default caps).
    bucket_bytes_cap_default = _DDPAttribute(
        lambda s: s.config.first_cap_bytes < _bucket_bytes_cap(s),
        instead=_READ_ONLY.format("pass bucket_cap_mb= and first_bucket_cap_mb="),
    )

    def __getattr__(self, name: str) -> Any:
        # Reached only when ordinary lookup failed (nn.Module keeps parameters,
        # buffers and submodules here): the model's own names still win. Only
        # the replicated root's class has it (about 0.2 us more per lookup of
        # the root's own submodules); a descriptor's AttributeError would be
        # replaced by nn.Module.__getattr__'s plain one, hence this.
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's, further along the MRO
        except AttributeError:
            why = NOT_HERE.get(name)
            if why is None:
                raise
        raise AttributeError(f"replicate(): {type(self).__name__!r} has no attribute {name!r}: it is {why}")

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """DDP's built-in hooks, as the stock Python hooks that compute the same.

        ``ALLREDUCE`` registers ``default_hooks.allreduce_hook`` and
        ``FP16_COMPRESS`` ``default_hooks.fp16_compress_hook``, on the
        replicated module's process group, through ``register_comm_hook``.

        Args:
            comm_hook_type: a ``torch.distributed.BuiltinCommHookType``.

        Raises:
            ValueError: ``comm_hook_type`` is not one of DDP 2.13's two.
        """
        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in hooks:
            raise ValueError(
                f"replicate(): _register_builtin_comm_hook({comm_hook_type!r}): DDP 2.13 has two built-in hooks, "
                "dist.BuiltinCommHookType.ALLREDUCE and FP16_COMPRESS; register any other with "
                "model.register_comm_hook(state, hook)"
            )
        state = get_state(self)
        state.register_comm_hook(state.group, hooks[comm_hook_type])


_FIXED = "pass it to replicate() instead ({}); it is fixed there"


class DDPSurface(DDPInternals):
    """DDP's attributes and methods, as a replicated module offers them (see the module docstring).

    Attributes:
        module: the model, seen as DDP's inner module: the same parameters,
            hooks and ``state_dict`` keys, without DDP's attributes (so
            without ``.module``: unwrapping loops end there); see
            [Note: model.module] in compat/view.py.
        process_group: the group gradients are averaged over.
        device_ids: ``[index]`` for a module replicate() moved to an
            accelerator (``device_ids=`` / ``device_id=``), else None, as DDP.
        output_device: that index, or None.
        dim: DDP's scatter dimension, as given (no effect, as in DDP today).
        broadcast_buffers / forward_sync_buffers: buffers broadcast before
            forwards; settable at run time, as on DDP.
        find_unused_parameters / static_graph: as given; unused parameters
            and changing graphs are always handled, and either lays the
            buckets out as DDP does for it.
        require_backward_grad_sync: gradient sync on (True) or off (no_sync).
        require_forward_param_sync: whether the next forward broadcasts
            buffers (the last one ran with gradient sync on), as DDP's.
        gradient_as_bucket_view: whether ``.grad`` is a view into its bucket
            (True unless ``gradient_as_bucket_view=False`` was given; DDP's default is False).
        bucket_bytes_cap: the bucket cap in bytes now in use (tuned, or as given).
        device_type: the parameters' device type (``"cpu"``, ``"cuda"``).
        parameters_to_ignore: names of the parameters and buffers left alone.
    """

    module = _TheModel()
    process_group = _DDPAttribute(lambda s: s.group, instead=_FIXED.format("process_group= or mesh="))
    device_ids = _DDPAttribute(
        lambda s: None if _device_index(s) is None else [_device_index(s)], instead=_FIXED.format("device_id=")
    )
    output_device = _DDPAttribute(_device_index, instead="outputs come back on the module's device, as in DDP")
    dim = _DDPAttribute(lambda s: s.config.dim, instead="DDP scatters nothing along it; inputs are per rank")
    broadcast_buffers = _DDPAttribute(lambda s: s.buffer_sync.before_forward, _set_before_forward)
    forward_sync_buffers = _DDPAttribute(lambda s: s.buffer_sync.before_forward, _set_before_forward)
    find_unused_parameters = _DDPAttribute(
        lambda s: s.config.find_unused_parameters,
        instead=_FIXED.format("find_unused_parameters= (unused parameters are always handled; it sets DDP's layout)"),
    )
    static_graph = _DDPAttribute(lambda s: s.config.static_graph, instead="call model._set_static_graph(), as on DDP")
    require_forward_param_sync = _DDPAttribute(lambda s: s.buffer_sync.due, _set_due)
    gradient_as_bucket_view = _DDPAttribute(lambda s: s.config.views, instead=_FIXED.format("gradient_as_bucket_view="))
    bucket_bytes_cap = _DDPAttribute(_bucket_bytes_cap, instead=_FIXED.format("bucket_cap_mb=, in MiB"))
    device_type = _DDPAttribute(_device_type, instead="move the model with model.to(device)")
    parameters_to_ignore = _DDPAttribute(
        lambda s: ignored_by_name(s.module, s.config.ignored_modules),
        instead="set model._ddp_params_and_buffers_to_ignore = names (re-planned at the next forward)",
    )

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's public switch, the same state as ``set_requires_gradient_sync``.

        ``model.require_backward_grad_sync = False`` makes the next backwards
        accumulate locally, as under DDP (and as ``no_sync()``, which sets it).
        """
        state: ReplicateState = get_state(self)
        return state.requires_gradient_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        get_state(self).set_requires_gradient_sync(value)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        """DDP's names of parameters and buffers left alone: neither averaged nor broadcast.

        Set before ``replicate()`` (``DistributedDataParallel.
        _set_params_and_buffers_to_ignore_for_model(model, names)``, as
        torchrec does) or after it: then the next forward with gradients
        re-plans without them ([Note: re-planning] in core/plan.py), so set it
        on every rank. Unset, reading it raises ``AttributeError``, as on a
        plain module. The names stay in the module's ``__dict__``, where DDP's
        helper puts them, so copies and pickles keep them.
        """
        try:
            return vars(self)[IGNORE_ATTRIBUTE]
        except KeyError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {IGNORE_ATTRIBUTE!r}") from None

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names: Any) -> None:
        check_ignored_names(names)
        vars(self)[IGNORE_ATTRIBUTE] = names
        get_state(self).note_change()

    @_ddp_params_and_buffers_to_ignore.deleter
    def _ddp_params_and_buffers_to_ignore(self) -> None:
        vars(self).pop(IGNORE_ATTRIBUTE, None)
        get_state(self).note_change()

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward takes rank 0's buffers (gradients or not), as DDP's.

        See [Note: buffer sync] in core/buffers.py.
        """
        state = get_state(self)
        return state.buffer_sync.wanted and bool(state.plan.buffers)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """torch's ``Joinable`` protocol: the hook a joined rank runs (see ``join``)."""
        return start_join(get_state(self), kwargs)

    @property
    def join_device(self) -> torch.device:
        """torch's ``Joinable`` protocol: where the join collectives run."""
        state: ReplicateState = get_state(self)
        return state.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """torch's ``Joinable`` protocol: the group averaged over."""
        state: ReplicateState = get_state(self)
        return state.group

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
        """DDP's: ``torch.nn.parallel.scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)``."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs: Any, output_device: Any) -> Any:
        """DDP's: ``torch.nn.parallel.gather(outputs, output_device, dim=self.dim)``."""
        return gather(outputs, output_device, dim=self.dim)

    def _set_static_graph(self) -> None:
        """DDP's: declares the graph static. Accepted; the reducer learns the graph, and the bucket layout
        stays as built (pass ``replicate(static_graph=True)`` for DDP's layout under a static graph).

        Raises:
            RuntimeError: after training started (unless already set), as DDP (DDP's message first).
        """
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", UserWarning, stacklevel=2)
            return
        num_forwards = get_state(self).num_forwards
        if num_forwards:
            raise RuntimeError(
                "set_static_graph() should be called before training loop starts and after "
                f"DistributedDataParallel is constructed. replicate(): {num_forwards} forward(s) already ran; "
                "the call changes nothing here (the reducer learns the graph), so drop it"
            )
        warn_no_effect("static_graph", True, "the reducer learns the graph from the first steps")
        vars(self)["static_graph"] = True  # read back as DDP's attribute from now on

    def _register_fused_optim(self, optim: type, *args: Any, optim_params: Any = None, **kwargs: Any) -> None:
        """DDP's optimizer fused into the comm hook: refused, naming torch's optimizer in backward.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError(
            f"replicate(): _register_fused_optim({optim.__name__}, ...) is DDP's private fusion and is not supported; "
            "use torch.distributed.optim._apply_optimizer_in_backward(optimizer_class, params, "
            "optimizer_kwargs={...}), "
            "which replicate() steps on the averaged gradients at the end of backward (grads are None after, as torch "
            "leaves them), or a plain optimizer.step() after backward"
        )

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """DDP's logging data: the keys set at construction, with DDP's names and value types.

        DDP's run-time timings (``avg_forward_compute_time``, ...) are not
        kept: ``torchreplicate.trace`` and ``log_summary`` time every step.
        """
        state = get_state(self)
        params = state.params
        index = _device_index(state)
        return {
            "world_size": state.world_size,
            "rank": dist.get_rank(state.group),
            "module_name": type(self).original_class.__name__,  # type: ignore[attr-defined]
            "backend_name": dist.get_backend(state.group),
            "device_ids": "" if index is None else str(index),
            "output_device": -1 if index is None else index,
            "broadcast_buffers": int(state.buffer_sync.before_forward),
            "bucket_cap_bytes": _bucket_bytes_cap(state),
            "find_unused_parameters": int(state.config.find_unused_parameters),
            "gradient_as_bucket_view": int(state.config.views),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": ", ".join(sorted({_dtype_name(p.dtype) for p in params})),
            "is_multi_device_module": int(len({p.device for p in params}) > 1),
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(torch.empty((), dtype=dtype).type()).rsplit(".", 1)[-1].removesuffix("Tensor").lower()


# Names whose definition in the model's own class wins over DDPSurface's ([Note: the model's own names win]):
# every DDP name defined here, but for the switches and the Join protocol the replicated class must answer.
_CLASS_ANSWERS = (
    *("require_backward_grad_sync", "_ddp_params_and_buffers_to_ignore"),
    *("join_hook", "join_device", "join_process_group"),
)
OWN_NAMES_WIN = tuple(
    name
    for cls in (DDPSurface, DDPInternals)
    for name in vars(cls)
    if not name.startswith("__") and name not in _CLASS_ANSWERS
)
