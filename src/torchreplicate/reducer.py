"""The gradient reducer: readiness bookkeeping, launching, finalising.

One ``Reducer`` per replicated module. It owns the flat bucket buffers, a
post-accumulate-grad hook per parameter, and the end-of-backward callback
that completes the step.

[Note: one collective sequence]
Every rank must launch the same collectives in the same order, whatever its
own graph did. So buckets are launched strictly by index, each exactly once
per synchronised backward, and the last bucket is always launched from the
end-of-backward callback. A rank may launch bucket ``k`` early (from a
gradient hook, overlapping backward) or late (from the callback); only the
timing differs, never the sequence. Anything a rank knows alone travels in
the last bucket, as a tail of ``num_params + 1`` elements: element ``i`` is 1
where this rank holds a gradient for parameter ``i`` and element
``num_params`` is 1 where a gradient arrived after its bucket was launched.
After the last bucket is reduced, every rank reads the same sums and takes the
same decisions: a parameter with no gradient on any rank keeps ``grad=None``;
any late gradient anywhere triggers one more agreed round (``_reduce_late``).
With a comm hook the tail is a tensor of its own (hooks may compress the
bucket, or pad its buffer in place, as batched PowerSGD does) and travels as
its own all-reduce, launched only after every hook's future has completed:
hooks launch further collectives from their future callbacks (PowerSGD), at
times that differ by rank, and the tail must not be enqueued among them.

[Note: when is a parameter ready]
A post-accumulate-grad hook fires once per accumulation into ``.grad``, which
can be several times in one backward (reentrant checkpointing runs nested
backward passes). The reducer counts firings per parameter and learns the
count each parameter reached in earlier synchronised steps (``expected``, a
running maximum). A bucket is launched from a hook only when every one of its
parameters has reached its expected count; until a parameter has been seen,
its expected count is 0 and its bucket waits for the end of backward. The
first step thus reduces everything at the end; later static steps overlap.
If a parameter fires again after its bucket was launched (the graph changed),
the gradient must not race with the collective that reads the bucket: at
launch, each parameter's ``.grad`` is detached from the bucket, so a late
accumulation lands in a fresh tensor, which the late round reduces.

[Note: hooks run one bucket at a time]
A comm hook may launch more collectives from its future's callbacks
(PowerSGD all-reduces its P and Q factors there). Those callbacks run on the
backend's threads when a collective completes, at a moment that differs by
rank, so if the next bucket's hook were called meanwhile, ranks would enqueue
collectives in different orders (gloo: "Received data size doesn't match").
So the hook of bucket ``k`` is called only once bucket ``k - 1``'s future is
complete; bucket ``k``'s communication still overlaps the backward computation
that produces bucket ``k + 1``.

[Note: the mean is taken on the way in]
Without a comm hook the reducer sends each rank's gradient already divided by
the divide factor, and the sum is the mean: no pass over the buckets after
the collective. In ``gradient_as_bucket_view`` mode, a fresh ``.grad`` (after
``zero_grad(set_to_none=True)``) is moved into its slot as ``grad * scale``
in one pass, and ``.grad`` is detached (None) until the end of backward; a
further accumulation in the same backward then arrives in a fresh ``.grad``
again and is folded in, scaled, unless the bucket has left (then it is late).
Slots filled any other way (``.grad`` already the view, accumulated under
``no_sync``) are scaled in place just before the bucket is launched. In copy
mode the copy into the slot at launch is the scaling pass. Late gradients
are unscaled and divided after their own round.

[Note: end of backward]
The callback is queued from a hook on the forward outputs (the outermost
backward pass reaches them first), or, when no forward hook ran (a method
other than ``forward``), from the first parameter hook of the backward. If
that first hook fires inside a nested pass (reentrant checkpointing around
the last layers, called through such a method), the callback runs when the
nested pass ends, and the rest of the backward queues another: the step is
reduced in two rounds, each agreed, and the second adds the mean of what the
outer pass accumulated. Still exact, as long as every rank's graph has the
same nesting (tests/dynamic_cases.py: other_method_checkpointed).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.buckets import BucketSpec, plan_buckets
from torchreplicate.collectives import WeakGroup
from torchreplicate.comm_hooks import CommHook, GradBucket, check_comm_hook, hook_result
from torchreplicate.engine_callback import queue_end_of_backward_callback

_NEVER = 1 << 60  # pending count of a bucket that cannot become ready from hooks


class Bucket:
    """One flat gradient buffer and the parameters laid out in it."""

    def __init__(
        self,
        index: int,
        spec: BucketSpec,
        params: Sequence[nn.Parameter],
        tail: int,
        wire_dtype: Optional[torch.dtype],
    ) -> None:
        self.index = index  # position in the launch order
        self.param_indices = spec.param_indices  # reducer indices, in buffer order
        # The flat buffer: the gradients, then ``tail`` extra elements (the
        # shared tail of [Note: one collective sequence], last bucket only).
        self.buffer = torch.zeros(spec.numel + tail, dtype=spec.dtype, device=spec.device)
        self.grads = self.buffer[: spec.numel]  # the gradient part, what comm hooks see
        # What the collective reduces: the buffer itself, or a copy in the
        # reduce dtype (replicate(reduce_dtype=...)), tail included.
        self.wire = self.buffer
        if wire_dtype is not None and wire_dtype != spec.dtype:
            self.wire = torch.zeros(spec.numel + tail, dtype=wire_dtype, device=spec.device)
        self.wire_grads = self.wire[: spec.numel]
        self.tail = self.wire[spec.numel :]
        self.views: list[torch.Tensor] = []  # per parameter, shaped like it
        offset = 0
        for index_ in spec.param_indices:
            param = params[index_]
            self.views.append(self.grads[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        self.work: Optional[dist.Work] = None  # default path: in-flight all-reduce
        self.future: Optional[torch.futures.Future] = None  # comm hook path
        self.hook_bucket: Optional[GradBucket] = None  # what the hook was given


class Reducer:
    """Averages gradients across ranks after every synchronised backward.

    Args:
        params: the parameters to reduce, in registration order.
        names: their fully qualified names, for error messages.
        group: the process group to reduce over.
        bucket_cap_bytes: bucket size cap.
        first_bucket_cap_bytes: cap of the first bucket.
        gradient_as_bucket_view: make ``p.grad`` a view into its bucket.
        reduce_dtype: dtype gradients travel in; None: the parameters'.
        gradient_divide_factor: divisor of the reduced sum; None: world size.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group: dist.ProcessGroup,
        *,
        bucket_cap_bytes: int,
        first_bucket_cap_bytes: int,
        gradient_as_bucket_view: bool,
        reduce_dtype: Optional[torch.dtype] = None,
        gradient_divide_factor: Optional[float] = None,
    ) -> None:
        self.params = list(params)  # the reduced parameters
        self.names = list(names)  # their FQNs
        self._group = WeakGroup(group)  # process group of the collectives, held weakly
        self.world_size = dist.get_world_size(group)
        self.reduce_dtype = reduce_dtype  # wire dtype of the default path, None: as the params
        self.divide_factor = float(gradient_divide_factor or self.world_size)  # sum / this
        self.scale: Optional[float] = 1.0 / self.divide_factor  # None while a comm hook averages
        # Per bucket, the scale as a 0-dim tensor in the multiply's math dtype:
        # bitwise the same result as the Python float, without wrapping a
        # scalar on every call (measured: 2.2 -> 0.9 us per fp32 multiply).
        self.bucket_scale: list[Optional[torch.Tensor]] = []
        self._divide_option = gradient_divide_factor  # as the user gave it
        self.rank = dist.get_rank(group)  # for error messages
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.requires_sync = True  # False inside no_sync(): accumulate locally
        self.num_steps = 0  # synchronised backwards completed
        self.comm_hook: Optional[CommHook] = None  # user comm hook, if any
        self.comm_hook_state: Any = None  # its state argument
        self.hook_tail: Optional[torch.Tensor] = None  # the flags' own tensor when a hook runs
        self.callback_queued = False  # finalise already queued for this backward
        num_params = len(self.params)
        self.num_params = num_params
        self.expected = [0] * num_params  # learned firings per step ([Note: when is a parameter ready])
        self.fired = [0] * num_params  # firings in this backward
        self.late = False  # a gradient arrived after its bucket launched
        self.late_anywhere = False  # some rank had a late gradient (read from the tail)
        self.scaled = [False] * num_params  # slot holds grad * scale ([Note: the mean is taken on the way in])
        self.saved_grads: list[Optional[torch.Tensor]] = [None] * num_params  # copy mode: .grad held aside
        self.buckets: list[Bucket] = []
        self.param_bucket: list[int] = [0] * num_params  # bucket of each parameter
        self.param_view: list[Optional[torch.Tensor]] = [None] * num_params  # slot of each parameter
        self.pending_start: list[int] = []  # per bucket: firings to wait for, at step start
        self.pending: list[int] = []  # per bucket: firings still awaited
        self.launched: list[bool] = []  # per bucket: launched in this backward
        self.next_launch = 0  # lowest bucket index not launched yet
        self.detached: list[int] = []  # buckets launched from hooks in this backward
        self.num_scaled: list[int] = []  # per bucket: slots scaled on the way in, this backward
        self.param_slots: list[tuple[nn.Parameter, torch.Tensor]] = []  # (param, its view)
        self.tail_template: Optional[torch.Tensor] = None  # the tail of an ordinary step
        self.hook_handles: list[Any] = []  # post-accumulate-grad hook handles
        self._build_buckets(bucket_cap_bytes, first_bucket_cap_bytes)
        self._install_hooks()

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group of the collectives."""
        return self._group.get()

    # -- set-up ------------------------------------------------------------

    def _build_buckets(self, cap_bytes: int, first_cap_bytes: int) -> None:
        specs = plan_buckets(
            [p.numel() for p in self.params],
            [p.dtype for p in self.params],
            [p.device for p in self.params],
            cap_bytes=cap_bytes,
            first_cap_bytes=first_cap_bytes,
        )
        last = len(specs) - 1
        for index, spec in enumerate(specs):
            tail = self.num_params + 1 if index == last else 0
            bucket = Bucket(index, spec, self.params, tail, self.reduce_dtype)
            self.buckets.append(bucket)
            for param_index, view in zip(spec.param_indices, bucket.views):
                self.param_bucket[param_index] = index
                self.param_view[param_index] = view
        self.launched = [False] * len(self.buckets)
        self.num_scaled = [0] * len(self.buckets)
        for bucket in self.buckets:
            math_dtype = torch.float64 if bucket.buffer.dtype == torch.float64 else torch.float32
            self.bucket_scale.append(torch.tensor(self.scale, dtype=math_dtype, device=bucket.buffer.device))
        self.param_slots = list(zip(self.params, self.param_view))
        tail = self.buckets[-1].tail
        # An ordinary step: every parameter has a gradient here, nothing late.
        self.tail_template = torch.ones_like(tail)
        self.tail_template[self.num_params] = 0
        self._recompute_pending()
        self.pending = list(self.pending_start)
        if self.gradient_as_bucket_view:
            for param, view in zip(self.params, self.param_view):
                if param.grad is not None:
                    view.copy_(param.grad)
                    param.grad = view

    def _install_hooks(self) -> None:
        for index, param in enumerate(self.params):
            hook = functools.partial(self._on_grad_accumulated, index)
            self.hook_handles.append(param.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        """Detaches the reducer from its parameters (before a re-plan)."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles.clear()

    def _recompute_pending(self) -> None:
        self.pending_start = []
        for bucket in self.buckets:
            counts = [self.expected[i] for i in bucket.param_indices]
            self.pending_start.append(_NEVER if 0 in counts else len(counts))

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Routes every bucket through ``hook(state, bucket)``; see comm_hooks.py."""
        check_comm_hook(hook)
        for option, value in (("reduce_dtype", self.reduce_dtype), ("gradient_divide_factor", self._divide_option)):
            if value is not None:
                raise ValueError(
                    f"register_comm_hook(): replicate({option}={value}) and a comm hook both decide "
                    f"how gradients are reduced; drop {option} (the hook owns the wire format and "
                    "the averaging, e.g. bf16_compress_hook)"
                )
        if self.comm_hook is not None:
            raise RuntimeError(
                "register_comm_hook(): a comm hook is already registered; it can be "
                "registered only once"
            )
        if self.num_steps > 0:
            raise RuntimeError(
                f"register_comm_hook(): training already ran {self.num_steps} synchronised "
                "step(s); register the hook before the first backward"
            )
        self.comm_hook = hook
        self.comm_hook_state = state
        self.scale = None  # the hook averages ([Note: the mean is taken on the way in])
        self.bucket_scale = [None] * len(self.buckets)
        last = self.buckets[-1]
        self.hook_tail = torch.zeros(self.num_params + 1, dtype=torch.float32, device=last.buffer.device)

    # -- backward: the hot path --------------------------------------------

    def queue_finalize(self) -> None:
        """Queues the end-of-backward work, once per backward."""
        if not self.callback_queued and self.requires_sync:
            self.callback_queued = True
            queue_end_of_backward_callback(self._finalize)

    def _on_grad_accumulated(self, index: int, param: nn.Parameter) -> None:
        # Runs after every accumulation into param.grad: keep it short.
        if not self.requires_sync:
            if self.gradient_as_bucket_view and param.grad is not self.param_view[index]:
                self._adopt_grad(index, param)
            return
        if not self.callback_queued:
            self.queue_finalize()
        fired = self.fired[index] + 1
        self.fired[index] = fired
        bucket_index = self.param_bucket[index]
        if self.launched[bucket_index]:
            self.late = True  # the fresh .grad is reduced by the late round
            return
        if self.gradient_as_bucket_view:
            grad = param.grad
            view = self.param_view[index]
            if grad is not view:
                scale = self.bucket_scale[bucket_index]
                if scale is None:
                    view.copy_(grad)
                    param.grad = view
                elif self.scaled[index]:
                    view.add_(grad, alpha=self.scale)  # a further accumulation: fold it in
                    param.grad = None
                else:
                    torch.mul(grad, scale, out=view)
                    param.grad = None
                    self.scaled[index] = True
                    self.num_scaled[bucket_index] += 1
        if fired == self.expected[index]:
            pending = self.pending[bucket_index] - 1
            self.pending[bucket_index] = pending
            if pending == 0:
                self._launch_ready()

    def _adopt_grad(self, index: int, param: nn.Parameter) -> None:
        # .grad was set to None (zero_grad) or replaced: move it into the bucket
        view = self.param_view[index]
        view.copy_(param.grad)
        param.grad = view

    def _launch_ready(self) -> None:
        # Launch, in index order, every ready bucket but the last ([Note: one
        # collective sequence]).
        last = len(self.buckets) - 1
        index = self.next_launch
        while index < last and self.pending[index] == 0:
            self._launch_from_hook(self.buckets[index])
            index += 1
        self.next_launch = index

    def _launch_from_hook(self, bucket: Bucket) -> None:
        # Every parameter here reached its expected count, so has a gradient.
        # Detach .grad from the bucket ([Note: when is a parameter ready]).
        params = self.params
        if self.gradient_as_bucket_view:
            for index in bucket.param_indices:
                params[index].grad = None
        else:
            for index, view in zip(bucket.param_indices, bucket.views):
                grad = params[index].grad
                self._copy_in(grad, view, bucket.index)
                self.saved_grads[index] = grad
                params[index].grad = None
        self.detached.append(bucket.index)
        self._launch(bucket)

    def _copy_in(self, grad: torch.Tensor, view: torch.Tensor, bucket_index: int) -> None:
        # Copy mode: the copy into the slot is the scaling pass.
        scale = self.bucket_scale[bucket_index]
        if scale is None:
            view.copy_(grad)
        else:
            torch.mul(grad, scale, out=view)

    def _scale_in_place(self, bucket: Bucket) -> None:
        # View mode: scale the slots not scaled on the way in.
        done = self.num_scaled[bucket.index]
        if done == len(bucket.param_indices):
            return
        scale = self.bucket_scale[bucket.index]
        if done == 0:
            bucket.grads.mul_(scale)
            return
        scaled = self.scaled
        for index, view in zip(bucket.param_indices, bucket.views):
            if not scaled[index]:
                view.mul_(scale)

    def _launch(self, bucket: Bucket) -> None:
        self.launched[bucket.index] = True
        is_last = bucket.index == len(self.buckets) - 1
        if self.comm_hook is None:
            if self.gradient_as_bucket_view:
                self._scale_in_place(bucket)
            if bucket.wire is not bucket.buffer:
                bucket.wire_grads.copy_(bucket.grads)
            bucket.work = dist.all_reduce(bucket.wire, group=self.group, async_op=True)
            return
        if bucket.index > 0:
            # [Note: hooks run one bucket at a time]
            self.buckets[bucket.index - 1].future.wait()
        hook_bucket = GradBucket(
            bucket.index,
            is_last,
            bucket.grads,
            [self.params[i] for i in bucket.param_indices],
            bucket.views,
        )
        bucket.hook_bucket = hook_bucket
        bucket.future = self.comm_hook(self.comm_hook_state, hook_bucket)
        # Duck-typed: Work.get_future() and Future.then() return torch's C++
        # future type, of which torch.futures.Future is only a subclass.
        if not callable(getattr(bucket.future, "wait", None)):
            raise TypeError(
                f"{self._where(bucket)}: comm hook: must return a torch.futures.Future, but for "
                f"bucket {bucket.index} returned {type(bucket.future).__name__}"
            )

    def _where(self, bucket: Bucket) -> str:
        # Rank, step and parameters, for errors a user must trace to a layer.
        names = [self.names[i] for i in bucket.param_indices]
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"replicate(): rank {self.rank}, step {self.num_steps}, bucket {bucket.index} ({shown})"

    # -- end of backward ---------------------------------------------------

    @torch.no_grad()
    def _finalize(self) -> None:
        self.callback_queued = False
        try:
            self._finish_step()
        finally:
            self._reset_step()

    def _finish_step(self) -> None:
        last = len(self.buckets) - 1
        unused_here: list[int] = []
        for bucket in self.buckets[self.next_launch :]:
            self._fill_at_end(bucket, unused_here)
            if bucket.index == last:
                self._write_tail(bucket, unused_here)
            self._launch(bucket)
        for bucket in self.buckets:
            self._wait(bucket)
        tail = self._tail()
        if self.comm_hook is not None:
            dist.all_reduce(tail, group=self.group)
        unused_everywhere, any_late = self._read_tail(tail, unused_here)
        self.late_anywhere = any_late
        late_grads = self._restore_grads(unused_everywhere)
        if any_late:
            self._reduce_late(late_grads)
        self._learn_expected()
        self.num_steps += 1

    def _fill_at_end(self, bucket: Bucket, unused_here: list[int]) -> None:
        # Backward is over: make each slot hold this rank's contribution.
        fired = self.fired
        params = self.params
        as_view = self.gradient_as_bucket_view
        for index, view in zip(bucket.param_indices, bucket.views):
            if as_view and fired[index]:
                continue  # the hook already put .grad in the slot
            grad = params[index].grad
            if grad is None:
                view.zero_()
                unused_here.append(index)
            elif as_view:
                if grad is not view:
                    view.copy_(grad)  # scaled with the bucket at launch
            else:
                self._copy_in(grad, view, bucket.index)

    def _tail(self) -> torch.Tensor:
        # Where this rank's flags travel ([Note: one collective sequence]).
        return self.buckets[-1].tail if self.comm_hook is None else self.hook_tail

    def _write_tail(self, bucket: Bucket, unused_here: list[int]) -> None:
        tail = self._tail()
        tail.copy_(self.tail_template)
        if unused_here:
            tail[torch.tensor(unused_here, device=tail.device)] = 0
        if self.late:
            tail[self.num_params] = 1

    def _wait(self, bucket: Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
            if bucket.wire is not bucket.buffer:
                bucket.grads.copy_(bucket.wire_grads)
            return
        future, bucket.future = bucket.future, None
        try:
            result = hook_result(future.wait(), bucket.hook_bucket)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{self._where(bucket)}: {error}") from None
        bucket.hook_bucket = None
        if result.data_ptr() != bucket.grads.data_ptr() or result.dtype != bucket.grads.dtype:
            bucket.grads.copy_(result.reshape(-1))

    def _read_tail(self, tail: torch.Tensor, unused_here: list[int]) -> tuple[set[int], bool]:
        # Same sums on every rank, hence the same decisions.
        any_late = tail[self.num_params].item() > 0
        if not unused_here:
            return set(), any_late  # used here, so used somewhere
        counts = tail[torch.tensor(unused_here, device=tail.device)].tolist()
        return {i for i, c in zip(unused_here, counts) if c == 0}, any_late

    def _restore_grads(self, unused_everywhere: set[int]) -> dict[int, torch.Tensor]:
        # Point every .grad at its reduced value; collect late local gradients.
        late_grads: dict[int, torch.Tensor] = {}
        params = self.params
        as_view = self.gradient_as_bucket_view
        if as_view and not unused_everywhere and not self.late_anywhere:
            for param, view in self.param_slots:  # the ordinary step
                param.grad = view
            return late_grads
        detached = set(self.detached)
        for bucket in self.buckets:
            was_detached = bucket.index in detached
            for index, view in zip(bucket.param_indices, bucket.views):
                param = params[index]
                if was_detached:
                    if param.grad is not None:
                        late_grads[index] = param.grad
                    if as_view:
                        param.grad = view
                    else:
                        grad = self.saved_grads[index]
                        self.saved_grads[index] = None
                        grad.copy_(view)
                        param.grad = grad
                elif index in unused_everywhere:
                    param.grad = None
                elif as_view:
                    if param.grad is not view:
                        param.grad = view
                elif param.grad is None:
                    param.grad = view.clone()
                else:
                    param.grad.copy_(view)
        return late_grads

    def _reduce_late(self, late_grads: dict[int, torch.Tensor]) -> None:
        # One more agreed round: every rank sends its late gradients (zeros
        # where it has none), bucket by bucket, and adds their mean.
        for bucket in self.buckets:
            extra = torch.zeros_like(bucket.grads)
            pieces = []
            offset = 0
            for index in bucket.param_indices:
                param = self.params[index]
                piece = extra[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                if index in late_grads:
                    piece.copy_(late_grads[index])
                pieces.append(piece)
            dist.all_reduce(extra, group=self.group)
            extra.div_(self.divide_factor)
            for index, piece in zip(bucket.param_indices, pieces):
                # A late gradient anywhere means the parameter was used there,
                # so every rank now holds a .grad for it; None means unused
                # everywhere, and nothing late can have arrived for it.
                grad = self.params[index].grad
                if grad is not None:
                    grad.add_(piece)

    def _learn_expected(self) -> None:
        if self.fired == self.expected:
            return
        learned = [max(a, b) for a, b in zip(self.expected, self.fired)]
        if learned != self.expected:
            self.expected = learned
            self._recompute_pending()

    def _reset_step(self) -> None:
        self.fired = [0] * self.num_params
        self.scaled = [False] * self.num_params
        self.num_scaled = [0] * len(self.buckets)
        self.pending = list(self.pending_start)
        self.launched = [False] * len(self.buckets)
        self.next_launch = 0
        self.detached = []
        self.late = False

