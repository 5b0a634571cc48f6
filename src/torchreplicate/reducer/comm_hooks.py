"""Comm hooks: DDP's hook protocol, a GradBucket-compatible view, checks.

A comm hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``. It is
handed a :class:`GradBucket` (the methods of ``torch.distributed.GradBucket``
that Python hooks use) and returns a future whose value holds the bucket's
reduced, averaged gradients. The stock hooks of
``torch.distributed.algorithms.ddp_comm_hooks`` run unchanged.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from torchreplicate.config import ReplicateConfig

CommHook = Callable[[Any, "GradBucket"], "torch.futures.Future[torch.Tensor]"]


class GradBucket:
    """What a comm hook sees of one bucket.

    The buffer is the bucket's flat gradient tensor; ``gradients()`` are views
    into it shaped like the parameters, so a hook that writes through either
    writes the bucket.
    """

    def __init__(
        self,
        index: int,
        is_last: bool,
        buffer: torch.Tensor,
        parameters: list[nn.Parameter],
        gradients: list[torch.Tensor],
    ) -> None:
        self._index = index  # bucket index, stable across steps
        self._is_last = is_last  # whether this is the step's last bucket
        self._buffer = buffer  # flat gradients of the bucket
        self._parameters = parameters  # parameters, in buffer order
        self._gradients = gradients  # views into the buffer, one per parameter

    def index(self) -> int:
        """The bucket's index; the same bucket has the same index every step."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket reduced in this step."""
        return self._is_last

    def buffer(self) -> torch.Tensor:
        """The flattened gradients of the bucket (1-D)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replaces the tensor that ``buffer()`` returns.

        Args:
            buffer: a 1-D tensor with as many elements as the bucket.
        """
        if not isinstance(buffer, torch.Tensor) or buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"GradBucket.set_buffer(): expected a tensor of {self._buffer.numel()} "
                f"elements, got {_describe(buffer)}"
            )
        self._buffer = buffer

    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients the bucket holds, in buffer order."""
        return self._parameters

    def gradients(self) -> list[torch.Tensor]:
        """The gradients, as views into the bucket shaped like the parameters."""
        return self._gradients


def check_comm_hook(hook: Any) -> None:
    """Refuses a hook that cannot follow the protocol, before training starts.

    Raises:
        TypeError: ``hook`` is not callable or does not take (state, bucket).
    """
    if not callable(hook):
        raise TypeError(
            f"register_comm_hook(): hook must be callable as hook(state, bucket), got {type(hook).__name__}"
        )
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # builtins and some C callables have no signature: trust them
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"register_comm_hook(): hook must take two positional arguments "
            f"(state, bucket), but {getattr(hook, '__name__', hook)!r} has signature "
            f"{signature}"
        ) from None


def check_hook_options(config: ReplicateConfig) -> None:
    """Refuses ``replicate()`` options that decide what a comm hook decides (the wire format, the averaging).

    Raises:
        ValueError: naming the option to drop.
    """
    for option in ("reduce_dtype", "gradient_divide_factor", "mp_policy"):
        value = getattr(config, option)
        if option == "mp_policy" and value is not None and config.wire_dtype in (None, torch.float32):
            continue  # a policy that keeps fp32 gradients on the wire leaves the wire to the hook
        if value is not None:
            raise ValueError(
                f"register_comm_hook(): replicate({option}={value}) and a comm hook both decide "
                f"how gradients are reduced; drop {option} (the hook owns the wire format and "
                "the averaging, e.g. bf16_compress_hook; with mp_policy, set its "
                "reduce_dtype=torch.float32)"
            )


def hook_result(value: Any, bucket: GradBucket) -> torch.Tensor:
    """Extracts and checks the tensor a comm hook's future resolved to.

    Accepts a tensor or a one-element list or tuple holding one (what
    ``Work.get_future()`` yields).

    Raises:
        TypeError: the value is not a tensor.
        ValueError: the tensor's element count differs from the bucket's.
    """
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"comm hook: the future of bucket {bucket.index()} must resolve to a torch.Tensor, got {_describe(value)}"
        )
    expected = sum(g.numel() for g in bucket.gradients())
    if value.numel() != expected:
        raise ValueError(
            f"comm hook: the future of bucket {bucket.index()} resolved to a tensor of "
            f"{value.numel()} elements, but the bucket holds {expected}"
        )
    return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
