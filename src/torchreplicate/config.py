"""The options of ``replicate()``, validated once, frozen."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Optional, Union, cast

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.errors import (
    DDP_BOTH_GROUPS_TEXT,
    DeviceIdError,
    GroupOptionError,
    ddp_mesh_dims_text,
    not_iterable_text,
    seed_device_id_text,
)

BUCKET_LAYOUTS = ("learned", "fixed", "tuned")  # replicate(bucket_layout=...): see ReplicateConfig
GRAPHS = ("learned", "dynamic")  # replicate(graph=...): [Note: flags read a step late] in reducer/flags.py
MiB = 1024 * 1024
DDP_DEFAULT_CAP_MB = 25  # DDP's bucket_cap_mb default, ours unless bucket_layout="tuned" measures the link
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket


@dataclass(frozen=True)
class ReplicateConfig:
    """Validated options of one ``replicate()`` call; see ``replicate`` for each.

    The process group is not kept here: ``ReplicateState`` holds it weakly
    (see ``faults/wire.py``'s ``WeakGroup``).

    Raises:
        TypeError / ValueError / RuntimeError: naming the option, the value
            and the fix.
    """

    ignored_modules: tuple[nn.Module, ...] = ()
    device_id: Optional[torch.device] = None
    bucket_cap_mb: Optional[float] = None  # None: DDP's 25 MiB, or chosen from timings when "tuned"
    bucket_layout: str = "learned"  # DDP's buckets; "fixed": never rebuilt; "tuned": from timings ([Note: tuning])
    first_bucket_cap_mb: Optional[float] = None  # None: DDP's rule (1 MiB, or bucket_cap_mb where given)
    graph: str = "learned"  # "dynamic": the flags are read at the end of every step
    tied_split: Optional[bool] = None  # None: only where a tuned layout finds it pays ([Note: tied parameters])
    gradient_as_bucket_view: Optional[bool] = None  # None: views, with DDP's default arithmetic
    broadcast_buffers: bool = True  # before forwards (DDP's forward_sync_buffers); core/buffers.py
    init_sync_buffers: bool = True  # at set-up: False only for broadcast_buffers=False alone, as DDP
    find_unused_parameters: bool = False
    static_graph: bool = False
    reduce_dtype: Optional[torch.dtype] = None
    gradient_divide_factor: Optional[float] = None
    stall_timeout: Union[float, timedelta, None] = 60.0
    mp_policy: Any = None  # a torch.distributed.fsdp.MixedPrecisionPolicy
    dim: Any = 0  # DDP's scatter dimension: no effect (compat/ddp_args.py), kept to answer model.dim as DDP does

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype gradients travel in: ``reduce_dtype``, or the policy's (FSDP2's default: param_dtype)."""
        return self.reduce_dtype if self.mp_policy is None else policy_dtypes(self.mp_policy)[1]

    @property
    def cap_bytes(self) -> Optional[int]:
        """The bucket cap in bytes; None: measured by the reducer (``bucket_layout="tuned"``, [Note: tuning])."""
        if self.bucket_layout == "tuned":
            return None
        return int((DDP_DEFAULT_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb) * MiB)

    @property
    def first_cap_bytes(self) -> int:
        """The first bucket's cap in bytes: ``first_bucket_cap_mb``, else DDP's: 1 MiB where
        ``bucket_cap_mb`` is left at its default, else the cap itself (the opt-in layouts: 1 MiB)."""
        if self.first_bucket_cap_mb is not None:
            return int(self.first_bucket_cap_mb * MiB)
        if self.bucket_layout == "learned" and self.bucket_cap_mb is not None:
            return int(self.bucket_cap_mb * MiB)
        return DDP_FIRST_BUCKET_BYTES

    @property
    def views(self) -> bool:
        """Whether each ``.grad`` is a view into its bucket (``gradient_as_bucket_view`` True or None)."""
        return self.gradient_as_bucket_view is not False

    @property
    def stall_timeout_s(self) -> Optional[float]:
        """``stall_timeout`` in seconds; None: the watchdog is off."""
        value = self.stall_timeout
        return value.total_seconds() if isinstance(value, timedelta) else value

    @property
    def wire_options(self) -> dict[str, str]:
        """What decides the size and order of every collective, as text: every rank must agree on it."""
        names = ("bucket_cap_mb", "bucket_layout", "graph", "first_bucket_cap_mb", "find_unused_parameters")
        names_too = ("static_graph", "tied_split", "broadcast_buffers", "init_sync_buffers")
        param_dtype = None if self.mp_policy is None else self.mp_policy.param_dtype
        options = {name: str(getattr(self, name)) for name in (*names, *names_too)}
        return {**options, "reduce_dtype": str(self.wire_dtype), "param_dtype": str(param_dtype)}

    def __post_init__(self) -> None:
        # Each option group refused with its own messages, in this order.
        self._check_switches()
        self._check_sizes()
        self._check_layout()
        self._check_arithmetic()

    def _check_switches(self) -> None:
        # The ignored modules, the True/False switches, tied_split.
        for module in self.ignored_modules:
            if not isinstance(module, nn.Module):
                raise TypeError(
                    "replicate(): ignored_modules must hold nn.Module objects, got "
                    f"{type(module).__name__}; pass e.g. ignored_modules=[model.head]"
                )
        for option in (
            "gradient_as_bucket_view",
            "broadcast_buffers",
            "init_sync_buffers",
            "find_unused_parameters",
            "static_graph",
        ):
            value = getattr(self, option)
            if not isinstance(value, bool) and not (option == "gradient_as_bucket_view" and value is None):
                raise TypeError(f"replicate(): {option} must be True or False, got {value!r}")
        if not isinstance(self.tied_split, (bool, type(None))):
            raise TypeError(
                f"replicate(): tied_split must be True, False or None, got {self.tied_split!r}; None (the "
                'default) splits only under bucket_layout="tuned", where it pays'
            )

    def _check_sizes(self) -> None:
        # The bucket caps in MiB, the stall timeout in seconds.
        for option in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, option)  # None: DDP's 25 MiB (measured when tuned), and its first-bucket rule
            if not _positive_or_none(value):
                raise ValueError(
                    f"replicate(): {option} must be a positive number of MiB, got {value!r}; pass a "
                    "finite value, e.g. 25 (a cap above the model's size gives one bucket), or leave "
                    "bucket_cap_mb=None: DDP's 25"
                )
        if not _positive_or_none(self.stall_timeout_s):
            raise ValueError(
                "replicate(): stall_timeout must be a positive number of seconds or a datetime.timedelta "
                f"(None turns the watchdog off), got {self.stall_timeout!r}; e.g. stall_timeout=300 for steps "
                "that may wait minutes for one rank (checkpointing on rank 0)"
            )

    def _check_layout(self) -> None:
        # bucket_layout and graph among their choices, then what "tuned" rules out.
        if self.bucket_layout not in BUCKET_LAYOUTS:
            raise ValueError(
                f"replicate(): bucket_layout must be one of {', '.join(map(repr, BUCKET_LAYOUTS))}, got "
                f'{self.bucket_layout!r}; "learned" (the default) reorders the buckets after the first step, '
                '"fixed" keeps them in reverse registration order at the caps given (the same on a replica '
                'that joins later), "tuned" also chooses their sizes from measured timings (faster on a slow '
                "link, not reproducible bit for bit)"
            )
        if self.graph not in GRAPHS:
            raise ValueError(
                f"replicate(): graph must be one of {', '.join(map(repr, GRAPHS))}, got {self.graph!r}; "
                '"learned" (the default) learns in the first step how often each gradient arrives and reads '
                'the summed flags a step late (no host read in a step), "dynamic" reads them at the end of '
                "every step, for graphs whose gradients arrive more often than in the first step"
            )
        if self.bucket_layout == "tuned":
            if self.bucket_cap_mb is not None:
                raise ValueError(
                    f'replicate(): bucket_layout="tuned" chooses the bucket cap itself, got bucket_cap_mb='
                    f'{self.bucket_cap_mb!r} too; drop bucket_cap_mb, or keep it with bucket_layout="learned" '
                    "(the default)"
                )
            refuse_tuning_if_deterministic()

    def _check_arithmetic(self) -> None:
        # The dtype gradients travel in (reduce_dtype, mp_policy), then what their sum is divided by.
        if self.reduce_dtype is not None and (
            not isinstance(self.reduce_dtype, torch.dtype) or not self.reduce_dtype.is_floating_point
        ):
            raise TypeError(
                "replicate(): reduce_dtype must be a floating torch.dtype such as torch.bfloat16, "
                f"got {self.reduce_dtype!r}"
            )
        # wire_dtype checks the policy's type (policy_dtypes), reduce_dtype given or not
        if self.mp_policy is not None and self.reduce_dtype not in (None, self.wire_dtype):
            raise ValueError(
                f"replicate(): reduce_dtype={self.reduce_dtype} and mp_policy (gradients reduced in "
                f"{self.wire_dtype}) disagree; set the policy's reduce_dtype and drop replicate(reduce_dtype=...)"
            )
        if not _positive_or_none(self.gradient_divide_factor):
            raise ValueError(
                "replicate(): gradient_divide_factor must be a positive number (1 for a sum, "
                f"None for the mean over ranks), got {self.gradient_divide_factor!r}; it must be finite"
            )


def refuse_tuning_if_deterministic() -> None:
    """Refuses ``bucket_layout="tuned"`` under ``torch.use_deterministic_algorithms(True)``.

    Tuning lets measured timings decide which gradients share a bucket, so
    which bytes the all-reduce sums together, and so the result's last bits
    from run to run: exactly what deterministic mode asks to rule out (as it
    rules out ``torch.backends.cudnn.benchmark``'s choices). With
    ``warn_only=True``, torch's own non-deterministic operations warn and
    run; so does this.

    Raises:
        RuntimeError: deterministic algorithms are enabled, not warn-only.
    """
    if not torch.are_deterministic_algorithms_enabled():
        return
    text = (
        'replicate(): bucket_layout="tuned" lets measured timings choose the buckets, so a rerun of the '
        "same seeded job may sum gradients in another order and differ in the last bits; "
        'torch.use_deterministic_algorithms(True) is set. Use the default bucket_layout="learned" '
        "(reproducible), or turn deterministic algorithms off"
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(text + " (warn_only=True: tuning stays on)", UserWarning, stacklevel=3)
        return
    raise RuntimeError(text)


def _positive_or_none(value: object) -> bool:
    # None (the option's default), or a finite number above 0 (not a bool).
    return value is None or (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    )


def backend_of(group: dist.ProcessGroup, device_type: str) -> str:
    """The backend ``group`` runs ``device_type`` tensors on ("gloo", "nccl", ...; "" where it runs none).

    Read from torch's ``dist.get_backend_config``, which names one backend per
    device type ("cpu:gloo,cuda:nccl"), not by comparing ``dist.get_backend``'s
    string, which is the whole spec for a group made with one ("cpu:gloo").
    """
    config = dist.get_backend_config(group)
    per_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return per_device.get(device_type, "") if per_device else config


def resolve_group(process_group: object, mesh: object, option: str = "mesh") -> Optional[dist.ProcessGroup]:
    """The group ``replicate(process_group=..., mesh=...)`` averages over (None: the world).

    Args:
        process_group: a ``ProcessGroup`` or None.
        mesh: a 1-D ``DeviceMesh`` (the data-parallel dimension) or None.
        option: the mesh option's name as the user spelled it, for messages.

    Raises:
        TypeError: a wrong type.
        GroupOptionError: (a ``ValueError`` and DDP's ``RuntimeError``) both
            given, or a mesh not 1-D; DDP's message first.
    """
    if process_group is not None and mesh is not None:
        raise GroupOptionError(
            f"{DDP_BOTH_GROUPS_TEXT} replicate(): pass either process_group= or {option}=, not both "
            f"(the {option}'s group is the process group)"
        )
    if mesh is not None:
        if type(mesh).__name__ != "DeviceMesh":
            raise TypeError(f"replicate(): {option} must be a DeviceMesh, got {type(mesh).__name__}")
        device_mesh: Any = mesh
        if device_mesh.ndim != 1:
            names = device_mesh.mesh_dim_names or ()
            slice_hint = f"{option}=mesh[{names[0]!r}]" if names else f'{option}=mesh["dp"] (name the dimensions)'
            raise GroupOptionError(
                f"{ddp_mesh_dims_text(mesh)} replicate(): {option} must be 1-D, the data-parallel dimension; "
                f"got a {device_mesh.ndim}-D mesh {tuple(names)}. Pass its data-parallel slice, e.g. {slice_hint}; "
                "parameters that are DTensors on the other dimensions (tensor parallel) keep their placements"
            )
        return cast(dist.ProcessGroup, device_mesh.get_group(0))
    if process_group is None or isinstance(process_group, dist.ProcessGroup):
        return process_group
    if type(process_group).__name__ == "DeviceMesh":
        raise TypeError(
            "replicate(): process_group must be a torch.distributed.ProcessGroup, got a DeviceMesh; "
            "pass mesh=mesh (1-D) or process_group=mesh.get_group()"
        )
    raise TypeError(
        "replicate(): process_group must be a torch.distributed.ProcessGroup "
        f"(e.g. from dist.new_group()), got {type(process_group).__name__}"
    )


def to_ignored_modules(ignored_modules: object) -> tuple[nn.Module, ...]:
    """Turns ``replicate(ignored_modules=...)`` into a tuple of modules.

    A container module (``nn.ModuleList``, ``nn.Sequential``) counts as the
    iterable of its children, as the seed's ``set(ignored_modules)`` does.

    Raises:
        TypeError: a single module that is not a container, or something that
            is not an iterable (the seed's message first: Python's).
    """
    if ignored_modules is None:
        return ()
    if isinstance(ignored_modules, nn.Module) and not hasattr(ignored_modules, "__iter__"):
        raise TypeError(
            f"{not_iterable_text(ignored_modules)}: replicate(): ignored_modules must be an iterable of "
            f"modules, got a single {type(ignored_modules).__name__}; pass a list, e.g. ignored_modules=[model.head]"
        )
    try:
        return tuple(cast(Iterable[nn.Module], ignored_modules))
    except TypeError:
        raise TypeError(
            f"{not_iterable_text(ignored_modules)}: replicate(): ignored_modules must be an iterable of "
            f"modules, got {type(ignored_modules).__name__}; pass e.g. ignored_modules=[model.head]"
        ) from None


def to_device(device_id: Union[int, torch.device, None]) -> Optional[torch.device]:
    """Turns ``replicate(device_id=...)`` into a device.

    An ``int`` names an index of the current accelerator (CUDA on a GPU
    machine); where there is none it means the CPU, so one script runs on both.

    Raises:
        DeviceIdError: (a ``TypeError``, ``ValueError`` and the seed's
            ``RuntimeError``) ``device_id`` is neither an int nor a
            torch.device (the seed's message first), a bool, a negative
            index, or a device this machine does not have.
    """
    if device_id is None:
        return None
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        if device_id < 0:
            raise DeviceIdError(
                f"replicate(): device_id must be a non-negative accelerator index, got {device_id}; "
                "pass e.g. int(os.environ['LOCAL_RANK'])"
            )
        return torch.device("cuda", device_id) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device_id, torch.device):
        if device_id.type == "cuda" and not torch.cuda.is_available():
            raise DeviceIdError(
                f"replicate(): device_id={device_id} but CUDA is not available here; pass None or torch.device('cpu')"
            )
        return device_id
    # A bool passes the seed's isinstance(int) check (DDP then refuses it as an index): no seed text.
    seed_text = "" if isinstance(device_id, bool) else f"{seed_device_id_text(device_id)}. "
    raise DeviceIdError(
        f"{seed_text}replicate(): device_id must be an int (accelerator index, e.g. LOCAL_RANK) or a "
        f"torch.device, got {device_id!r} ({type(device_id).__name__}); pass e.g. torch.device('cpu') or 0"
    )


def policy_dtypes(policy: Any) -> tuple[Optional[torch.dtype], Optional[torch.dtype]]:
    """(param_dtype, the wire dtype) of a ``MixedPrecisionPolicy``.

    Raises:
        TypeError: not a ``torch.distributed.fsdp.MixedPrecisionPolicy``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            "replicate(): mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(policy).__name__}; e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        )
    return policy.param_dtype, policy.reduce_dtype or policy.param_dtype
