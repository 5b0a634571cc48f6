"""How a bucket's gradients become their average: one interface, two paths.

``AllReduce`` is the default path: every rank's gradient is scaled on the way
into its bucket and the buckets are summed by ``all_reduce`` (optionally in a
lower-precision wire dtype). ``HookReduction`` hands each bucket to a
DDP-style comm hook. Communication over tensors: ``bind`` once per bucket
layout (each bucket's tensors, ``BucketTensors``), then per synchronised
backward each bucket (bucket.py) calls ``launch`` and ``wait`` with its
index, in index order. The step's flags travel in an all-reduce of their
own (flags.py), which the reducer launches after the last bucket's launch or,
where a reduction says so (``flags_after_waits``), once every bucket is back.
Neither this file nor bucket.py imports
the other: the reducer binds them.

The bucket's collectives are launched here and waited through the module's
``Watch`` (faults/wire.py, which owns every other collective and wait).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, cast

import torch
import torch.distributed as dist

from torchreplicate.errors import compiled_hook_error, complex_wire_error
from torchreplicate.faults.wire import Watch, WeakGroup
from torchreplicate.reducer.comm_hooks import CommHook, GradBucket, check_comm_hook, hook_result
from torchreplicate.torch_internals import traced_all_reduce


class BucketTensors(NamedTuple):
    """What a reduction sees of one bucket: tensors only.

    Attributes:
        buffer: the flat buffer of the gradients.
        numel: how many elements it holds.
        params: the parameters, in buffer order (a comm hook's bucket lists them).
        views: each parameter's gradient, a view into ``buffer``.
        names: the parameters' fully qualified names, for errors.
    """

    buffer: torch.Tensor
    numel: int
    params: Sequence[torch.Tensor]
    views: Sequence[torch.Tensor]
    names: Sequence[str]

    @property
    def grads(self) -> torch.Tensor:
        """The gradient part of the buffer."""
        return self.buffer[: self.numel]


class Divisor:
    """The one divisor of a module's summed gradients: ``replicate(gradient_divide_factor=)``, else the world
    size (the mean); inside a ``Join``, the ranks still training (core/join.py). Applied with DDP's two
    arithmetics, each where DDP applies it ([Note: the mean is taken on the way in]): a gradient copied
    into its bucket is multiplied by the reciprocal (``scale``); one that already is its bucket view, a late
    sum and a sparse sum are divided (``divide``).

    Args:
        default: the divisor outside a Join.
    """

    __slots__ = ("default", "value", "_scales")

    def __init__(self, default: float) -> None:
        self.default = self.value = default
        # 1 / value as a 0-dim tensor per math dtype: bitwise the same product as the Python float, without
        # wrapping a scalar on every call (measured: 2.2 -> 0.9 us per fp32 multiply); on the host even for
        # a GPU bucket: a CPU scalar, which CUDA kernels take as DDP's Python number
        self._scales: dict[torch.dtype, torch.Tensor] = {}

    def scale(self, dtype: torch.dtype) -> torch.Tensor:
        """1 / the divisor, to multiply a ``dtype`` tensor by (real even for a complex one: exact per part); the
        same tensor, changed in place with the divisor (``set``)."""
        math = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
        if (scale := self._scales.get(math)) is None:
            scale = self._scales[math] = torch.tensor(1.0 / self.value, dtype=math)
        return scale

    def divide(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, divided in place (DDP's arithmetic where it divides)."""
        return tensor.div_(self.value)

    def set(self, value: Optional[float]) -> None:
        """The divisor from now on (a Join: the ranks still training); None: the default."""
        value = self.default if value is None else value
        if value != self.value:
            self.value = value
            for scale in self._scales.values():
                scale.fill_(1.0 / value)


class Reduction:
    """The interface: how a bucket's gradients travel and become their average.

    Subclasses keep their configuration from ``__init__`` and everything tied
    to one bucket layout from ``bind``, so one object serves every re-plan of
    a module.
    """

    divisor = Divisor(1.0)  # the one divisor of the sums (set by bind)
    weak_group: WeakGroup  # the group the collectives run on (set by bind)
    flags_after_waits = False  # the flags' all-reduce waits until every bucket is back (comm hooks)

    def bind(self, buckets: Sequence[BucketTensors], group: WeakGroup, watch: Watch) -> None:
        """Prepares for a bucket layout.

        ``watch`` waits each collective the reduction launches itself
        ([Note: stall watchdog] in watchdog.py).
        """
        raise NotImplementedError

    def scale(self, index: int) -> Optional[torch.Tensor]:
        """What bucket ``index``'s gradients are multiplied by on the way in (a 0-dim tensor), or None."""
        return None

    def launch(self, index: int, zeros: bool = False) -> Any:
        """Starts reducing bucket ``index``; returns the handle ``wait`` takes. ``zeros``: this rank's part is
        zeros (a rank that joined, or whose step raised: the same collectives as the ranks that train), in a
        tensor of its own, but for the flags where the bucket's room carries them."""
        raise NotImplementedError

    def wait(self, index: int, handle: Any) -> Optional[torch.Tensor]:
        """Waits for bucket ``index``; its gradients then hold the reduced average (launched with ``zeros``: the
        bucket is left alone, and the reduced tensor of its own is returned)."""
        raise NotImplementedError

    def traced(self, grad: torch.Tensor, group_name: str) -> torch.Tensor:
        """Under compiled autograd: the average of ``grad``, as a traceable expression ([Note: compiled autograd]).

        Raises:
            RuntimeError: this reduction cannot be traced (a comm hook), on every rank at trace time.
        """
        raise compiled_hook_error()

    def wire_bytes(self) -> int:
        """Bytes one backward hands to the collectives (per rank): the bound buckets as they travel."""
        raise NotImplementedError

    def carries_flags(self) -> bool:
        """Whether the last bucket's buffer can carry the flags as it travels ([Note: the flags carried] in
        flags.py): it is summed as it is, so small integers stay exact."""
        return False

    def flags_room(self) -> Optional[torch.Tensor]:
        """Where the flags travel inside the last bucket's collective (its buffer's room), or None: apart."""
        return None


class AllReduce(Reduction):
    """The default path: scale on the way in, then one ``all_reduce`` (a sum) per bucket.

    [Note: the mean is taken on the way in]
    Each rank sends its gradient already divided by the divide factor, so the
    sum is the mean: no pass over the buckets after the collective. In
    ``gradient_as_bucket_view`` mode a fresh ``.grad`` is moved into its slot
    as ``grad * scale`` in one pass (``Bucket.take``), and ``.grad`` is detached
    (None) until the end of backward; a further accumulation in the same
    backward then arrives in a fresh ``.grad`` again and is folded in, scaled,
    unless the bucket has left (then it is late). Slots filled any other way
    (``.grad`` already the view, accumulated under ``no_sync``) are scaled in
    place just before the bucket is launched (``Bucket.launch``). In copy
    mode the copy into the slot at launch is the scaling pass. The scale is
    the reduction's divisor's (``Divisor.scale``: a 0-dim tensor, changed in
    place with the divisor); the bucket applies it. Late gradients are
    unscaled and divided after their own round.

    Args:
        reduce_dtype: dtype gradients travel in; None: the parameters'.
        gradient_divide_factor: divisor of the sum; None: the world size.
    """

    def __init__(
        self, reduce_dtype: Optional[torch.dtype] = None, gradient_divide_factor: Optional[float] = None
    ) -> None:
        # - Configuration
        self.reduce_dtype = reduce_dtype
        self.gradient_divide_factor = gradient_divide_factor
        # - Bound to one bucket layout (bind)
        self._watch = Watch()  # waits each all-reduce (the module's: the stall watchdog, or plain)
        self._buckets: Sequence[BucketTensors] = ()
        # Per bucket, what the collective reduces: the bucket's buffer itself, or
        # a copy in the reduce dtype (flags' room included).
        self.wires: list[torch.Tensor] = []

    def bind(self, buckets: Sequence[BucketTensors], group: WeakGroup, watch: Watch) -> None:
        self.weak_group = group
        self._watch = watch
        self._buckets = buckets
        # replicate(gradient_divide_factor=...), else the world size: the mean
        self.divisor = Divisor(float(self.gradient_divide_factor or dist.get_world_size(group.get())))
        self.wires = []
        for bucket in buckets:
            buffer = bucket.buffer
            wire = buffer
            if self.reduce_dtype is not None and self.reduce_dtype != buffer.dtype:
                if buffer.is_complex():
                    raise complex_wire_error(bucket.names[0], buffer.dtype, self.reduce_dtype)
                wire = torch.zeros(buffer.numel(), dtype=self.reduce_dtype, device=buffer.device)
            self.wires.append(wire)

    def scale(self, index: int) -> Optional[torch.Tensor]:
        return self.divisor.scale(self._buckets[index].buffer.dtype)

    def wire_bytes(self) -> int:
        return sum(wire.numel() * wire.element_size() for wire in self.wires)  # in the reduce dtype

    def traced(self, grad: torch.Tensor, group_name: str) -> torch.Tensor:
        # [Note: compiled autograd]
        # Under compiled autograd (torch._dynamo.config.compiled_autograd with
        # a compiled step that runs backward), the reducer's gradient hook is
        # traced into the backward graph, where no Python bookkeeping, async
        # work handle or end-of-backward callback can run (queue_callback is
        # refused, or silently dropped, torch 2.13). So the traced path is
        # DDP's "python reducer" one: each gradient is divided and summed
        # across ranks by a functional all-reduce, in the graph (inductor may
        # fuse them into buckets), in the wire dtype when one is set
        # (reduce_dtype, mp_policy). Its limits, as DDP's: every rank must
        # produce a gradient for the same parameters each step (no unused
        # parameters), and no comm hook (refused at trace time; docs/modern-stack.md:
        # Compiled autograd).
        mean = grad / self.divisor.value
        if self.reduce_dtype is not None:
            mean = mean.to(self.reduce_dtype)
        return traced_all_reduce(mean, group_name)  # the caller's copy_ casts back

    def carries_flags(self) -> bool:
        return self.reduce_dtype is None  # summed as it is; build_buckets gives room in float32 or float64 only

    def flags_room(self) -> Optional[torch.Tensor]:
        if not self._buckets or self.wires[-1] is not self._buckets[-1].buffer:
            return None
        last = self._buckets[-1]
        return last.buffer[last.numel :] if last.buffer.numel() > last.numel else None

    def launch(self, index: int, zeros: bool = False) -> Any:
        wire, bucket = self.wires[index], self._buckets[index]
        if zeros:
            wire = torch.zeros_like(wire)
            wire[bucket.numel :].copy_(bucket.buffer[bucket.numel :])  # the flags, where its room carries them
        elif wire is not bucket.buffer:
            wire.copy_(bucket.buffer)
        # the bucket's own collective, launched here (faults/wire.py launches those outside the buckets)
        return dist.all_reduce(wire, group=self.weak_group() or self.weak_group.get(), async_op=True), wire

    def wait(self, index: int, handle: Any) -> Optional[torch.Tensor]:
        work, wire = cast(tuple[dist.Work, torch.Tensor], handle)
        self._watch.wait(work)
        if wire is self.wires[index] and wire is not self._buckets[index].buffer:
            self._buckets[index].buffer.copy_(wire)
        return wire


def real_parts(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real and imaginary parts (``torch.view_as_real``); any other as it is."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


class HookReduction(Reduction):
    """The comm-hook path: ``hook(state, bucket) -> Future[Tensor]`` per bucket.

    The hook averages, so slots hold plain local gradients. The flags travel
    in an all-reduce of their own, launched only after every hook's future
    has completed: hooks may compress the bucket or pad its buffer in place
    (batched PowerSGD), and they launch further collectives from their
    future callbacks, at times that differ by rank, which the flags must not
    be enqueued among.

    [Note: hooks run one bucket at a time]
    A comm hook may launch more collectives from its future's callbacks
    (PowerSGD all-reduces its P and Q factors there). Those callbacks run on
    the backend's threads when a collective completes, at a moment that
    differs by rank, so if the next bucket's hook were called meanwhile,
    ranks would enqueue collectives in different orders (gloo: "Received data
    size doesn't match"). So the hook of bucket ``k`` is called only once
    bucket ``k - 1``'s future is complete; bucket ``k``'s communication still
    overlaps the backward computation that produces bucket ``k + 1``.

    [Note: complex buckets and comm hooks]
    A hook sees a complex bucket as real: its buffer and gradients are
    ``torch.view_as_real`` views (real and imaginary parts interleaved,
    twice the elements), so every stock hook averages, compresses or
    factorises both parts alike, and none drops the imaginary part (a real
    cast of a complex tensor does, with only a warning).

    Args:
        state: the hook's first argument.
        hook: the comm hook.
    """

    flags_after_waits = True  # [Note: hooks run one bucket at a time]

    def __init__(self, state: Any, hook: CommHook) -> None:
        check_comm_hook(hook)
        # - Configuration
        self.state = state
        self.hook = hook
        # - Bound to one bucket layout (bind)
        self._buckets: Sequence[BucketTensors] = ()
        # - Per step: the last bucket's future, waited before the next hook call
        self._previous: Any = None

    def bind(self, buckets: Sequence[BucketTensors], group: WeakGroup, watch: Watch) -> None:
        # The hook launches its own collectives, waited through its futures:
        # only the flags' all-reduce is watched (docs/faults.md).
        self.weak_group = group
        self._buckets = buckets
        self.divisor = Divisor(float(dist.get_world_size(group.get())))  # the hook takes the mean

    def wire_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self._buckets)

    def _grad_bucket(self, index: int, grads: torch.Tensor, views: Sequence[torch.Tensor]) -> GradBucket:
        # DDP's bucket object; complex as real: [Note: complex buckets and comm hooks]
        return GradBucket(
            index,
            index == len(self._buckets) - 1,
            real_parts(grads).view(-1),
            list(self._buckets[index].params),  # type: ignore[arg-type]
            [real_parts(view) for view in views],
        )

    def launch(self, index: int, zeros: bool = False) -> Any:
        if index > 0 and self._previous is not None:  # [Note: hooks run one bucket at a time]
            done = getattr(self._previous, "done", None)  # duck-typed futures (torchft's) may lack it
            if done is None or not done():  # a future done already is not waited on
                self._previous.wait()
        bucket = self._buckets[index]
        if zeros:  # the hook on a zero bucket of its own (the reducer's flags follow, apart)
            grads = torch.zeros_like(bucket.grads)
            at = [view.storage_offset() - bucket.grads.storage_offset() for view in bucket.views]
            views = [grads.as_strided(v.shape, v.stride(), o) for v, o in zip(bucket.views, at, strict=True)]
            grad_bucket = self._grad_bucket(index, grads, views)
        else:
            grad_bucket = self._grad_bucket(index, bucket.grads, bucket.views)
        future = self.hook(self.state, grad_bucket)
        # Duck-typed: Work.get_future() and Future.then() return torch's C++
        # future type, of which torch.futures.Future is only a subclass.
        if not callable(getattr(future, "wait", None)):
            raise TypeError(
                f"comm hook: must return a torch.futures.Future, but for bucket {index} "
                f"returned {type(future).__name__}"
            )
        self._previous = future
        return future, grad_bucket, zeros  # what the hook returned (a duck-typed torch future), and was handed

    def wait(self, index: int, handle: Any) -> Optional[torch.Tensor]:
        if index == len(self._buckets) - 1:
            self._previous = None  # the step's last future: not kept, with its tensors, until the next step
        future, grad_bucket, zeros = handle
        result = hook_result(future.wait(), grad_bucket)
        if zeros:
            return result
        grads = real_parts(self._buckets[index].grads).view(-1)  # what the hook was handed
        if result.data_ptr() != grads.data_ptr() or result.dtype != grads.dtype:
            grads.copy_(result.reshape(-1))
        return None
