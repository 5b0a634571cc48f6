"""The options of ``replicate()``, validated once, frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ReplicateConfig:
    """Validated options of one ``replicate()`` call; see ``replicate`` for each.

    The process group is not kept here: ``ReplicateState`` holds it weakly
    (see ``collectives.WeakGroup``).

    Raises:
        TypeError / ValueError / RuntimeError: naming the option, the value
            and the fix.
    """

    ignored_modules: tuple[nn.Module, ...] = ()
    device_id: Optional[torch.device] = None
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    gradient_as_bucket_view: bool = True
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    static_graph: bool = False
    reduce_dtype: Optional[torch.dtype] = None
    gradient_divide_factor: Optional[float] = None

    def __post_init__(self) -> None:
        for module in self.ignored_modules:
            if not isinstance(module, nn.Module):
                raise TypeError(
                    "replicate(): ignored_modules must hold nn.Module objects, got "
                    f"{type(module).__name__}; pass e.g. ignored_modules=[model.head]"
                )
        for option in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"replicate(): {option} must be a positive number of MiB, got {value!r}")
        for option in ("gradient_as_bucket_view", "broadcast_buffers", "find_unused_parameters", "static_graph"):
            value = getattr(self, option)
            if not isinstance(value, bool):
                raise TypeError(f"replicate(): {option} must be True or False, got {value!r}")
        if self.reduce_dtype is not None and (
            not isinstance(self.reduce_dtype, torch.dtype) or not self.reduce_dtype.is_floating_point
        ):
            raise TypeError(
                "replicate(): reduce_dtype must be a floating torch.dtype such as torch.bfloat16, "
                f"got {self.reduce_dtype!r}"
            )
        factor = self.gradient_divide_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
            raise ValueError(
                "replicate(): gradient_divide_factor must be a positive number (1 for a sum, "
                f"None for the mean over ranks), got {factor!r}"
            )


def check_process_group(process_group: object) -> None:
    """Refuses a ``replicate(process_group=...)`` that is not a process group."""
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "replicate(): process_group must be a torch.distributed.ProcessGroup "
            f"(e.g. from dist.new_group()), got {type(process_group).__name__}"
        )


def to_device(device_id: Union[int, torch.device, None]) -> Optional[torch.device]:
    """Turns ``replicate(device_id=...)`` into a device.

    An ``int`` names an index of the current accelerator (CUDA on a GPU
    machine); where there is none it means the CPU, so one script runs on both.

    Raises:
        RuntimeError: ``device_id`` is neither an int nor a torch.device.
    """
    if device_id is None:
        return None
    if isinstance(device_id, torch.device):
        return device_id
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        if torch.cuda.is_available():
            return torch.device("cuda", device_id)
        return torch.device("cpu")
    raise RuntimeError(f"Expected device_id to be int or torch.device, but got {type(device_id)}")
