"""The flags: what each rank knows alone, summed across ranks with the step's collectives.

See [Note: one collective sequence] in reducer.py. The flags are a few
elements, summed across ranks at every synchronised step, launched without
waiting. Every rank reads the same sums, so every rank takes the same
decision.

[Note: the flags' own all-reduce]
At DDP's layout (the default) the gradient buckets carry DDP's bytes and
nothing else, so each bucket's all-reduce sums the bytes DDP's sums, at the
same offsets ([Note: DDP's buckets] in layout/plan.py), and the flags travel
in a small all-reduce of their own, as DDP's used-parameters map does under
``find_unused_parameters=True``. It leaves right after the last bucket's
(with a comm hook: once every hook's future is done, [Note: hooks run one
bucket at a time] in reduction.py), and nothing in the step waits for it.
On the host (gloo) the ranks' flags are all-gathered and summed where they
land (faults/wire.py's ``SummedGather``: half the CPU of gloo's all-reduce
ring at this size, the same sums). There its bytes queue behind the last
bucket's on the same connection, so it ends about with it; its work is
kept past the step and waited at the next release, the optimizer step,
forward or synchronised backward that follows ([Note: works kept past a
step] in faults/wire.py: a gloo work freed after
``destroy_process_group()`` aborted the process), and the next step's end
reads it. Sent before the last bucket instead, it would hold
one of the group's two worker threads while an earlier bucket still holds
the other, and the last bucket would wait for a thread. On an accelerator
it follows the last bucket on the group's stream, and a stream of its own
waits for it and copies the sums to the host (``StagedSums.stage``): the
step's stream never waits for it. Every rank places it alike, a joined
rank too (``Reducer._collectives``, the one sequence).

[Note: the flags carried]
Where the layout is not DDP's (``bucket_layout="tuned"`` or ``"fixed"``,
whose bytes are not DDP's anyway), the flags ride in the last bucket's
all-reduce instead, in room after its gradients (``Bucket``'s ``room``): one
collective fewer per step, which on a slow link is a round trip, and on a
busy host a collective's CPU work. Only where the sums stay exact integers:
the last bucket in float32 or float64, summed as it is (no wire dtype, no
comm hook); elsewhere they travel apart. The sums are copied out once the
last bucket is back (``StepFlags.landed``), and read as the apart flags are.

[Note: desync detection]
Ranks that run a different number of backwards (one ran an extra backward,
or skipped one) still pair their collectives one by one: the k-th
all-reduce of one rank meets the k-th of the other, so the gradients of
different training steps get averaged together, silently. A counter of
synchronised backwards cannot see it (it counts the pairing itself). What
differs is the training clock: how many optimizer steps each rank took (an
optimizer over the module's parameters: ``OptimizerSteps``), and, after
a divergent re-plan, the bucket layout. Each value travels as residues: for
every modulus m in MODULI, a one-hot block of m elements with a 1 at
``value % m``. Summed over ranks, a block has one non-zero element exactly
when all ranks share that residue, so "all ranks agree" is exact in any wire
dtype (sums of ones up to the world size), and values that differ by less
than the product of the moduli (2310) always disagree somewhere. A mismatch
raises on every rank after one more agreed collective that names the ranks.

A Join ([Note: join] in core/join.py) is the one place where the clocks
differ legitimately: a joined rank shadows steps it does not take. Its end
is an agreed point (every rank runs ``post_hook``), where every clock is
re-based to the highest (``TrainingClock.catch_up``): the joined rank counts
the steps it shadowed, and the check stays armed for what follows.

[Note: flags read a step late]
Reading the sums is a host read: on a GPU, the CPU stops queueing work (the
optimizer step, the next forward) until the last all-reduce is done. So, at
the default ``graph="learned"``, only the first synchronised step of each
reducer (the step that learns how often each parameter's gradient arrives)
reads them at its end. Every later step copies its sums to host memory
without waiting (``StagedSums.stage``: a non-blocking copy into pinned memory
and an event, on an accelerator) and reads them at the end of the next
synchronised step, after that step's own collectives (``StagedSums.check``,
through a NumPy view of the host copy: by then the event, one step old, has
long completed, so the wait it makes, if any, leaves the accelerator busy).
What a user sees change:

- a desync is named one synchronised step later, on every rank (the same
  step on every rank, after collectives that still pair one by one);
- no late round: a gradient beyond the learned count that arrives after its
  bucket left (the graph changed) is not reduced; the next step raises on
  every rank, naming the step and (on the ranks that had one) the
  parameter, with the fix: ``replicate(..., graph="dynamic")``, which reads
  the sums at the end of every step as before (one host read per step);
- what needs no other rank stays at once: a rank holding no gradient for a
  parameter reads that parameter's count before ``.grad`` is set (so a
  parameter no rank used keeps ``grad=None``), as DDP does with
  ``find_unused_parameters=True``.

The decision is the same on every rank (the option is agreed at set-up and
the step count is), so the collective sequence stays one, also for a rank
that joined (``Reducer.shadow_step``). The sums of the last step before a
re-plan or the end of training are not read.
"""

from __future__ import annotations

import contextlib
import enum
import math
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchreplicate.errors import (
    DesyncReport,
    StepRaisedError,
    backward_raised_error,
    desync_error,
    late_after_learning,
)
from torchreplicate.faults.wire import HeldWorks, Watch, all_reduce, all_reduce_small, digest, gather_objects

if TYPE_CHECKING:
    from torchreplicate.reducer.bucket import Bucket, ParamSlot


def layout_digest(buckets: Sequence[Bucket], unbucketed: Sequence[ParamSlot]) -> int:
    """A digest of a bucket layout (names, shapes, dtypes in order): equal on ranks whose layouts match.

    Args:
        buckets: the buckets, in launch order.
        unbucketed: the slots reduced outside the buckets (sparse gradients).
    """
    layout = [[(s.name, tuple(s.param.shape), str(s.dtype)) for s in b.slots] for b in buckets]
    layout.append([(s.name, tuple(s.param.shape), str(s.dtype)) for s in unbucketed])
    return digest(repr(layout).encode())


MODULI = (2, 3, 5, 7, 11)  # coprime: residues tell apart values closer than 2310
_RESIDUE_WIDTH = sum(MODULI)
_PERIOD = math.prod(MODULI)  # 2310: residues repeat with it


class TrainingClock:
    """A module's training clock: optimizer steps over its parameters ([Note: desync detection]).

    Shared by the module's state (which sets the parameters to watch at each
    plan) and its reducers (which send the clock with the flags);
    ``OptimizerSteps`` advances it.
    """

    __slots__ = ("steps", "param_ids", "held", "__weakref__")

    def __init__(self) -> None:
        self.steps = 0  # optimizer steps that touched the module's replicated parameters
        self.param_ids: frozenset[int] = frozenset()  # ids of those parameters, as planned
        # works of the step not waited yet (the staged flags' on the host, the buffers sent ahead),
        # released at the next forward, synchronised backward or optimizer step ([Note: works kept past
        # a step] in faults/wire.py), done by then
        self.held = HeldWorks()

    def catch_up(self, steps: int) -> None:
        """Re-bases the clock at an agreed point (a Join's end): the steps the ranks still training took."""
        assert steps >= self.steps, (steps, self.steps)
        self.steps = steps

    @contextlib.contextmanager
    def caught_up_on_raise(
        self, group: Callable[[], dist.ProcessGroup], device: torch.device, watch: Watch
    ) -> Iterator[None]:
        """Where a step raised on some ranks (``StepRaisedError``, raised inside, on every rank alike):
        first one MAX all-reduce of the clocks, so the ranks that skipped its optimizer step count it."""
        try:
            yield
        except StepRaisedError:
            steps = torch.tensor([float(self.steps)], dtype=torch.float64, device=device)
            (highest,) = watch.read_on_host(steps, all_reduce(steps, group(), op=dist.ReduceOp.MAX))
            self.catch_up(int(highest))
            raise


class OptimizerSteps:
    """Advances the training clocks: one global optimizer step post-hook (torch's public
    ``register_optimizer_step_post_hook``) adds a step to every clock whose parameters
    the stepped optimizer holds ([Note: desync detection]).

    One per process, held by the registry (core/registry.py), which installs
    it with the first replicated module and removes it with the last.
    """

    def __init__(self) -> None:
        self.clocks: weakref.WeakSet[TrainingClock] = weakref.WeakSet()  # the live replicated modules' clocks
        self.handle: Any = None  # torch's hook handle; None until installed
        # optimizer -> (its param_groups' shape when read, ids of its parameters)
        self.params_of: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], frozenset[int]]] = (
            weakref.WeakKeyDictionary()
        )

    @torch.compiler.disable
    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        shape = tuple(len(group["params"]) for group in optimizer.param_groups)
        cached = self.params_of.get(optimizer)
        if cached is None or cached[0] != shape:
            ids = frozenset(id(p) for group in optimizer.param_groups for p in group["params"])
            cached = self.params_of[optimizer] = (shape, ids)
        for clock in list(self.clocks):
            if not clock.param_ids.isdisjoint(cached[1]):
                clock.steps += 1
                clock.held.release()

    def install(self) -> None:
        """Registers the hook with torch, once."""
        if self.handle is None:
            self.handle = register_optimizer_step_post_hook(self)

    def let_go_at_exit(self) -> None:
        """At interpreter exit: drops, without waiting, the works every clock still holds (no optimizer
        step followed their forward or backward), while the interpreter is whole: one freed later, after
        ``destroy_process_group()``, aborted the process ([Note: flags read a step late])."""
        for clock in list(self.clocks):
            clock.held.let_go()

    def uninstall(self) -> None:
        """Removes the hook from torch."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class FlagSums(NamedTuple):
    """What the summed flags say, the same on every rank.

    Attributes:
        unused_everywhere: indices of parameters no rank holds a gradient for.
        any_late: some rank had a gradient arrive after its bucket was launched.
        raised: how many ranks said they raised ([Note: a backward that raised] in reducer.py); 0 where
            the sums are read a step late (what they say is raised then).
    """

    unused_everywhere: frozenset[int]
    any_late: bool
    raised: int = 0


_HEAD = 3  # after the parameters' elements: the late flag, the ranks whose backward raised, the sum of their ranks


def num_flags(num_params: int) -> int:
    """How many elements the flags of ``num_params`` parameters take."""
    return num_params + _HEAD + 2 * _RESIDUE_WIDTH


def one_hot_residues(value: int) -> list[float]:
    """``value`` as one-hot residue blocks, one per modulus in ``MODULI``."""
    return [float(i == value % modulus) for modulus in MODULI for i in range(modulus)]


def residues_agree(sums: Sequence[float]) -> bool:
    """Whether summed one-hot residue blocks came from equal values on every rank."""
    starts = [sum(MODULI[:i]) for i in range(len(MODULI))]
    return all(sum(x != 0 for x in sums[s : s + m]) == 1 for s, m in zip(starts, MODULI, strict=True))


_STAGED_WIDTH = _HEAD + 2 * _RESIDUE_WIDTH  # what a step late reads: the head, then both residue blocks


class StagedSums:
    """One reducer's summed flags of a step, read a step late ([Note: flags read a step late]).

    On the host (gloo on CPU) the step's all-reduce is not waited for: its
    work is kept past the step (``HeldWorks``, faults/wire.py) and waited
    at the next release, at the latest the next step's end, long done by
    then, and the sums are read through a NumPy view of the flags' tensor, which the
    next step leaves alone (``StepFlags`` uses two in turn). On an
    accelerator the stream waits for the all-reduce, a non-blocking copy
    takes the sums to pinned host memory, and an event says when it landed.

    Args:
        device: where the flags travel.
    """

    def __init__(self, device: torch.device) -> None:
        accelerated = device.type != "cpu"
        self.host = torch.zeros(_STAGED_WIDTH, dtype=torch.float32, pin_memory=accelerated) if accelerated else None
        self.values: Any = None if self.host is None else self.host.numpy()  # read as host memory
        self.event: Optional[torch.Event] = torch.Event(device) if accelerated else None
        # on an accelerator, a stream of its own waits for the flags and copies them: the step's stream
        # never waits for them ([Note: the flags' own all-reduce])
        self.side: Optional[torch.Stream] = torch.Stream(device) if accelerated else None
        self.device = device
        self.step = -1  # the step staged; -1: none
        self.clock = 0
        self.late_params: tuple[str, ...] = ()

    def stage(
        self,
        rest: torch.Tensor,
        host_view: Any,
        work: Any,
        watch: Watch,
        step: int,
        clock: int,
        late_params: Sequence[str],
    ) -> None:
        """Stages a step's summed late flag and residues (``rest``, being summed by ``work``; None: summed)
        without waiting on the host (the caller keeps ``work`` past the step: [Note: works kept past a
        step] in faults/wire.py); ``host_view``: ``rest`` as a NumPy array (host flags only)."""
        if self.event is None:
            self.values = host_view
        else:
            assert self.host is not None and self.side is not None
            step_stream = torch.accelerator.current_stream(self.device)  # the flags' device, not the current
            with self.side:
                if work is not None:
                    watch.wait(work)  # the side stream waits, not the host, nor the step's stream
                else:
                    self.side.wait_stream(step_stream)  # carried: summed with the last bucket, on the step's
                self.host.copy_(rest, non_blocking=True)
                self.event.record(self.side)
        self.step, self.clock, self.late_params = step, clock, tuple(late_params)

    def check(self, group: Callable[[], dist.ProcessGroup], layout_digest: int, watch: Watch) -> None:
        """Raises what the sums staged a step ago say, if anything (every rank reads the same sums); once.

        Args:
            group: returns the module's process group (called only to raise).
            layout_digest: this rank's bucket layout digest.
            watch: polls the event (the stall watchdog looks at the peers meanwhile).

        Raises:
            RuntimeError: the ranks disagreed (a desync, named after one more
                collective), or a gradient came late on some rank.
        """
        if self.step < 0:
            return  # nothing staged
        if self.event is not None:  # recorded a step ago: done, unless the device runs a step behind
            watch.wait_event(self.event)
        rest, step, self.step = self.values.tolist(), self.step, -1
        raise_on_desync(rest, group, self.device, self.clock, layout_digest, step, watch)
        if rest[0] > 0:
            raise late_after_learning(dist.get_rank(group()), step, round(rest[0]), self.late_params)


def raise_on_desync(
    rest: Sequence[float],
    group: Callable[[], dist.ProcessGroup],
    device: torch.device,
    clock: int,
    layout_digest: int,
    step: int,
    watch: Watch,
) -> None:
    """Raises, on every rank, when the summed flags after the parameters' counts (``rest``) say that
    a step raised on some ranks but not all ([Note: a backward that raised] in reducer.py: named with
    what they raised where ``watch``, the stall watchdog, holds their notes), or that the ranks
    disagree ([Note: desync detection]: one more agreed collective gathers who is where)."""
    if rest[1] > 0 and rest[1] < dist.get_world_size(group()):
        raised, rank_sum = round(rest[1]), round(rest[2])
        what = watch.raised_notes([rank_sum] if raised == 1 else range(dist.get_world_size(group())))
        raise backward_raised_error(dist.get_rank(group()), step, raised, rank_sum, what)
    clocks_agree = residues_agree(rest[_HEAD : _HEAD + _RESIDUE_WIDTH])
    if not (clocks_agree and residues_agree(rest[_HEAD + _RESIDUE_WIDTH :])):
        mine = DesyncReport(dist.get_rank(group()), clock, layout_digest)
        raise desync_error(gather_objects(mine, group(), device), mine.rank, step, clocks_agree)


class FlagRoute(enum.Enum):
    """Where a step's flags travel, chosen once per bucket layout (``StepFlags``, at the reducer's bind),
    the same on every rank: the collective sequence is one ([Note: one collective sequence] in reducer.py).
    """

    CARRIED = "carried"  # in the last bucket's room, summed with it ([Note: the flags carried])
    AFTER_LAST = "after the last bucket"  # their own collective, right after the last bucket's launch (DDP's layout)
    AFTER_WAITS = "after every wait"  # their own collective once every bucket is back (a comm hook's futures)


class StepFlags:
    """Writes this rank's flags, sums them across ranks, and reads the sums back.

    Layout: element ``i < num_params`` is 1 where this rank holds a gradient
    for parameter ``i``; element ``num_params`` is 1 where a gradient arrived
    after its bucket was launched (a late round follows); then 1 and this rank
    where its backward raised ([Note: a backward that raised] in reducer.py); then the residues
    of the training clock and of the layout digest ([Note: desync detection]).
    Two tensors of them, used in turn: a step's sums may be read at the end
    of the next step (``StagedSums``) while that step sums the other.

    Args:
        device: where the flags travel (the last bucket's device).
        num_params: number of reduced parameters.
        layout_digest: a digest of the bucket layout, equal on ranks that agree.
        clock: the module's training clock, sent at every write.
        carrier: the last bucket's room, where the flags travel with its gradients ([Note: the flags
            carried]); None (DDP's layout, a comm hook, a wire dtype): in a collective of their own.
        after_waits: their own collective leaves once every bucket is back (a comm hook), not right after
            the last bucket's launch.
    """

    def __init__(
        self,
        device: torch.device,
        num_params: int,
        layout_digest: int,
        clock: TrainingClock,
        carrier: Optional[torch.Tensor] = None,
        after_waits: bool = False,
    ) -> None:
        self.num_params, self.clock, self.layout_digest = num_params, clock, layout_digest
        self.carrier = carrier
        self.route = (
            FlagRoute.CARRIED if carrier is not None else FlagRoute.AFTER_WAITS if after_waits else FlagRoute.AFTER_LAST
        )
        self.tensors = [torch.zeros(num_flags(num_params), dtype=torch.float32, device=device) for _ in range(2)]
        self.turn = 0  # the tensor this step writes and sums
        self.index_cache: dict[tuple[int, ...], torch.Tensor] = {}  # unused parameters' indices, by pattern
        # on the host, each tensor's sums a step late, as NumPy views made once (no tensor read in a step)
        self.host_views = [t[num_params:].numpy() for t in self.tensors] if device.type == "cpu" else [None, None]
        # An ordinary step: a gradient for every parameter, nothing late; the
        # clock's residues are written at each step, the layout's once here.
        self.ordinary = torch.ones_like(self.tensors[0])
        self.ordinary[num_params:] = 0
        layout_at = num_params + _HEAD + _RESIDUE_WIDTH
        self.ordinary[layout_at:] = torch.tensor(one_hot_residues(layout_digest), dtype=torch.float32)
        # Every clock's residues, on the flags' device, made once: residues repeat with the
        # product of the moduli, so writing the clock is a device copy of one row, never a
        # host-to-device copy in the step (on a GPU, a synchronisation from pageable memory)
        rows = [one_hot_residues(value) for value in range(_PERIOD)]
        self.clock_rows = torch.tensor(rows, dtype=torch.float32, device=device)
        self.ready: Optional[torch.Event] = torch.Event(device) if device.type != "cpu" else None  # see wait

    def wait(self, work: Any, watch: Watch) -> None:
        """Waits for the flags' all-reduce (None: they came back with the last bucket) before a read of the
        sums in this step: on an accelerator the stream waits, then the host polls an event through
        ``watch`` (the stall watchdog looks at the peers) instead of blocking plainly in the read until
        NCCL's own timeout."""
        watch.wait_on_host(self.tail, work, self.ready)

    def indices(self, unused_here: Sequence[int]) -> torch.Tensor:
        """``unused_here`` as an index tensor on the flags' device, made once per pattern (the last 8 kept):
        a steady step's pattern repeats, and a copy from pageable host memory would stop the host on a GPU
        (a new pattern's goes from pinned memory, without waiting)."""
        key = tuple(unused_here)
        if (found := self.index_cache.get(key)) is None:
            if len(self.index_cache) >= 8:
                del self.index_cache[next(iter(self.index_cache))]
            host = torch.tensor(key, dtype=torch.long)
            device = self.tail.device
            found = host.to(device) if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
            self.index_cache[key] = found
        return found

    @property
    def tail(self) -> torch.Tensor:
        """This step's flags (summed in place by their all-reduce)."""
        return self.tensors[self.turn]

    def nbytes(self) -> int:
        """Bytes of one step's flags in an all-reduce of their own (carried: counted with the last bucket)."""
        return 0 if self.route is FlagRoute.CARRIED else self.tail.numel() * self.tail.element_size()

    def send(
        self,
        unused_here: Sequence[int],
        late: bool,
        group: dist.ProcessGroup,
        raised: bool = False,
        raised_earlier: bool = False,
    ) -> Optional[dist.Work]:
        """Fills this step's flags (the clock as it is now) and launches their all-reduce; returns its work.
        Carried: writes them into the last bucket's room, which its launch sums; returns None.
        ``raised``: this rank's step raised before its flags left ([Note: a backward that raised] in
        reducer.py): no gradient; ``raised_earlier``: the last step raised after they left."""
        tail = self.tail.copy_(self.ordinary)
        at = self.num_params + _HEAD
        tail[at : at + _RESIDUE_WIDTH].copy_(self.clock_rows[self.clock.steps % _PERIOD])
        if unused_here:
            tail[self.indices(unused_here)] = 0
        if late:
            tail[self.num_params] = 1
        if raised:
            tail[: self.num_params + 3] = torch.tensor([0.0] * self.num_params + [0.0, 1.0, dist.get_rank(group)])
        elif raised_earlier:
            tail[self.num_params + 1 : self.num_params + 3] = torch.tensor([1.0, dist.get_rank(group)])
        return self._travel(tail, group)

    def send_zeros(self, group: dist.ProcessGroup) -> Optional[dist.Work]:
        """A joined rank's flags: zeros, summed with the others' ([Note: join] in core/join.py)."""
        return self._travel(self.tail.zero_(), group)

    def _travel(self, tail: torch.Tensor, group: dist.ProcessGroup) -> Optional[dist.Work]:
        if self.carrier is not None:  # FlagRoute.CARRIED
            self.carrier.copy_(tail)  # summed with the last bucket, read back by ``landed``
            return None
        # waited by the reducer through the watch where the sums are read now (or on an accelerator),
        # on the host kept past the step ([Note: works kept past a step] in faults/wire.py)
        return all_reduce_small(tail, group)

    def landed(self, sums: Optional[torch.Tensor] = None) -> None:
        """Carried: the last bucket is back; its room (or ``sums``, a joined rank's) holds the summed flags."""
        assert self.carrier is not None, "carried flags only"
        self.tail.copy_(self.carrier if sums is None else sums)

    def read(
        self,
        unused_here: Sequence[int],
        group: Callable[[], dist.ProcessGroup],
        step: int,
        watch: Watch,
    ) -> FlagSums:
        """Reads the summed flags (their all-reduce waited) at the end of ``step``.

        Raises:
            RuntimeError: on every rank, when the ranks disagree ([Note: desync detection]).
        """
        rest = self.tail[self.num_params :].tolist()  # one transfer: late flag, then both residue blocks
        with self.clock.caught_up_on_raise(group, self.tail.device, watch):
            raise_on_desync(rest, group, self.tail.device, self.clock.steps, self.layout_digest, step, watch)
        return FlagSums(self.unused_everywhere(unused_here), rest[0] > 0, round(rest[1]))

    def stage(
        self,
        staged: StagedSums,
        work: Any,
        watch: Watch,
        step: int,
        unused_here: Sequence[int],
        late_params: Sequence[str],
        group: Callable[[], dist.ProcessGroup],
    ) -> FlagSums:
        """Reads the sums the last step staged (``StagedSums.check``: raises what they say), stages
        this step's (being summed by ``work``) for the next step's end, and returns what this step
        needs now: the parameters no rank used, read only where this rank used none (then ``work``
        is waited now: [Note: flags read a step late])."""
        held = self.clock.held
        held.release()  # the last step's flags' work (and this step's buffers sent ahead): done by now
        try:
            with self.clock.caught_up_on_raise(group, self.tail.device, watch):
                staged.check(group, self.layout_digest, watch)  # after this step's collectives: every rank raises here
        except RuntimeError:
            self.wait(work, watch)  # nothing left in flight that the next step's flags would race with
            raise
        unused: frozenset[int] = frozenset()
        if unused_here:
            self.wait(work, watch)
            work, unused = None, self.unused_everywhere(unused_here)
        rest = self.tail[self.num_params :]
        staged.stage(rest, self.host_views[self.turn], work, watch, step, self.clock.steps, late_params)
        if work is not None and staged.event is None:
            held.hold(work)  # waited at the next release ([Note: works kept past a step] in faults/wire.py)
        self.turn ^= 1
        return FlagSums(unused, any_late=False)

    def unused_everywhere(self, unused_here: Sequence[int]) -> frozenset[int]:
        """Of ``unused_here`` (this rank holds no gradient for them), those no rank used."""
        if not unused_here:  # used here means used somewhere
            return frozenset()
        counts = self.tail[self.indices(unused_here)].tolist()  # the one read: which parameters no rank used
        return frozenset(i for i, c in zip(unused_here, counts, strict=True) if c == 0)
