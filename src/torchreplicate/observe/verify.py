"""``verify_replicas()``: are the replicas bitwise identical? One collective of digests; names what differs.

Every rank hashes each replicated tensor's bytes (a 64-bit BLAKE2b digest)
and the ranks all-gather one int64 tensor of digests: the whole check when
the replicas agree. Where a digest differs, a second collective (agreed: every
rank saw the same digests) all-gathers those tensors only, so every rank
computes the same report: which tensor, which ranks, how many elements and
the largest difference.

Which value is "right": the one most ranks hold (ties go to the group with
the lowest rank, so with two ranks rank 0's, the value ``replicate()``
broadcasts). The other ranks are the ones named.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.core.registry import get_state
from torchreplicate.faults.wire import digest, gather_objects
from torchreplicate.reducer.dtensors import local

_NO_TENSOR = -(2**63)  # the digest of a missing tensor (a gradient that is None)


class Mismatch(NamedTuple):
    """One tensor that is not the same on every rank.

    Attributes:
        kind: "parameter", "buffer", "gradient", "optimizer state", or
            "tensor list" (the ranks hold different tensors: ``name``
            describes the first difference).
        name: the tensor's fully qualified name.
        ranks: the ranks whose value differs from the reference.
        reference_rank: the lowest rank holding the value most ranks hold.
        max_difference: largest ``|value - reference|`` over the elements and
            the differing ranks, in float64 (NaN if a NaN is involved; inf if
            one side has no gradient).
        num_differing: elements that differ bitwise (the most over the
            differing ranks).
        numel: elements of the tensor.
        first_index: index of the first differing element on the first
            differing rank (empty when not applicable).
        note: what else to say (a missing gradient), or "".
    """

    kind: str
    name: str
    ranks: tuple[int, ...]
    reference_rank: int
    max_difference: float
    num_differing: int
    numel: int
    first_index: tuple[int, ...] = ()
    note: str = ""

    def describe(self) -> str:
        """One line for the error message."""
        who = ", ".join(str(r) for r in self.ranks)
        plural = "s" if len(self.ranks) > 1 else ""
        if self.kind == "tensor list":
            return f"the ranks hold different tensors: {self.name} (rank{plural} {who} vs rank {self.reference_rank})"
        verb = "differ" if plural else "differs"
        text = f"{self.kind} {self.name!r}: rank{plural} {who} {verb} from rank {self.reference_rank}"
        if self.note:
            return f"{text}: {self.note}"
        text += f": {self.num_differing} of {self.numel} elements, max |difference| {self.max_difference:.3g}"
        if self.first_index:
            text += f", first at {list(self.first_index)}"
        return text


class ReplicaReport(NamedTuple):
    """What ``verify_replicas()`` found; the same on every rank.

    Attributes:
        num_tensors: tensors compared.
        num_bytes: their bytes (on this rank).
        world_size: ranks compared.
        mismatches: every tensor that differs; empty when the replicas agree.
    """

    num_tensors: int
    num_bytes: int
    world_size: int
    mismatches: tuple[Mismatch, ...]

    @property
    def ok(self) -> bool:
        """Whether every tensor is bitwise identical on every rank."""
        return not self.mismatches

    def message(self) -> str:
        """The error text: every differing tensor, one per line."""
        if self.ok:
            return f"verify_replicas(): {self.num_tensors} tensors bitwise identical on {self.world_size} ranks"
        lines = [
            f"verify_replicas(): {len(self.mismatches)} of {self.num_tensors} tensors differ across the "
            f"{self.world_size} ranks:"
        ]
        lines += [f"  {m.describe()}" for m in self.mismatches]
        if any(m.kind == "optimizer state" or "'optimizer state'" in m.name for m in self.mismatches):
            lines.append(
                "The optimizer's state differs: load it on every rank (optimizer.load_state_dict() after "
                "torch.load(..., map_location=...) on each rank, as DDP's tutorial does), not on rank 0 alone: "
                "replicate() broadcasts the model's weights, never an optimizer's state."
            )
        if any(m.kind == "buffer" for m in self.mismatches):
            lines.append(
                "Buffers are broadcast from rank 0 before every forward; a forward that updates them "
                "(BatchNorm statistics) makes them differ until the next forward: check before a "
                "forward, or pass buffers=False."
            )
        return "\n".join(lines)


class ReplicaMismatchError(RuntimeError):
    """The replicas differ; raised on every rank. ``error.report`` holds the ``ReplicaReport``."""

    def __init__(self, report: ReplicaReport) -> None:
        super().__init__(report.message())
        self.report = report


class _Entry(NamedTuple):
    kind: str
    name: str
    tensor: Optional[torch.Tensor]  # None: a gradient that is None here
    shape: tuple[int, ...]
    dtype: torch.dtype


@torch.no_grad()
def verify_replicas(
    model: nn.Module,
    *,
    grads: bool = False,
    buffers: Optional[bool] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    raise_on_mismatch: bool = True,
) -> ReplicaReport:
    """Checks that every rank holds bitwise the same parameters and buffers (and gradients).

    ::

        torchreplicate.verify_replicas(model)  # raises ReplicaMismatchError on every rank if not

    One all-gather of a 64-bit digest per tensor when the replicas agree;
    where they differ, a second all-gather of the differing tensors names
    each one, the ranks that differ and the largest difference. Call it at
    the same point on every rank (it is a collective). Checked: the
    parameters ``replicate()`` broadcasts (frozen ones too; not those of
    ``ignored_modules`` or ``fully_shard`` children) and, with
    ``grads=True``, the ``.grad`` of the averaged ones (call after
    ``backward()``, before the optimizer step; a sparse gradient is compared
    densely). Hashing reads every byte once on the CPU (a GPU tensor is
    copied to the host).

    Args:
        model: a module ``replicate()`` was applied to.
        grads: also compare gradients. Default False.
        buffers: compare the replicated buffers. Default None: when they are
            broadcast before forwards (``replicate(broadcast_buffers=True)``,
            the default). A forward that updates buffers (BatchNorm) leaves
            them differing until the next broadcast, by design: the next
            forward's, or under ``no_sync`` the first forward after a synced
            one ([Note: buffer sync] in core/buffers.py).
        optimizer: also compare this optimizer's state over the replicated
            parameters (each state tensor and number: Adam's ``step``,
            ``exp_avg``, ``exp_avg_sq``, SGD's momentum buffer), named
            ``<parameter>.<key>``: a state loaded on one rank only differs.
            Default None.
        raise_on_mismatch: raise ``ReplicaMismatchError`` on a mismatch
            (default True) or return the report.

    Returns:
        A ``ReplicaReport`` (``.ok``), the same on every rank.

    Raises:
        ReplicaMismatchError: on every rank, if a tensor differs and
            ``raise_on_mismatch``.
        ValueError: ``model`` is not replicated.
    """
    try:
        state = get_state(model)
    except ValueError as error:
        raise ValueError(f"verify_replicas(): {error}") from None
    if buffers is None:
        buffers = state.buffer_sync.before_forward
    entries = _entries(model, state.plan, grads=grads, buffers=buffers)
    if optimizer is not None:
        entries += _optimizer_entries(optimizer, state.plan)
    num_bytes = sum(e.tensor.numel() * e.tensor.element_size() for e in entries if e.tensor is not None)
    group = state.group
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return ReplicaReport(len(entries), num_bytes, 1, ())
    device = state.device
    description = repr([(e.kind, e.name, e.shape, str(e.dtype)) for e in entries])
    # first what each rank compares (a fixed size: the lists may differ, an optimizer's state on one rank)
    described = digest(description.encode())
    heads = _gathered([described, len(entries)], group, device)
    if len({tuple(head) for head in heads}) > 1:
        mismatches: tuple[Mismatch, ...] = (_different_lists(entries, [h[0] for h in heads], group, device),)
    else:
        table = _gathered([described] + [tensor_digest(e.tensor) for e in entries], group, device)  # [rank][1 + i]
        differing = [i for i in range(len(entries)) if len({row[1 + i] for row in table}) > 1]
        mismatches = _explain(entries, differing, table, group, device) if differing else ()
    report = ReplicaReport(len(entries), num_bytes, world_size, mismatches)
    if mismatches and raise_on_mismatch:
        raise ReplicaMismatchError(report)
    return report


def tensor_digest(tensor: Optional[torch.Tensor]) -> int:
    """A 64-bit digest (signed, as int64 holds it) of a tensor's bytes; equal iff the bytes are, but for collisions.

    Args:
        tensor: any tensor (a sparse one is made dense, a DTensor its local
            shard, a GPU tensor copied to the host), or None.
    """
    return _NO_TENSOR if tensor is None else digest(_host_bytes(tensor).numpy())  # its memory, no copy


def _host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    shard = local(tensor.detach())  # a DTensor: its shard on this rank
    dense = shard.to_dense() if shard.layout != torch.strided else shard
    return dense.cpu().contiguous().reshape(-1).view(torch.uint8)


def _entries(model: nn.Module, plan: Any, *, grads: bool, buffers: bool) -> list[_Entry]:
    entries = [
        _Entry("parameter", name, p, tuple(p.shape), p.dtype)
        for name, p in zip(plan.candidate_names, plan.candidates, strict=True)
    ]
    if buffers:
        names = {id(b): name for name, b in model.named_buffers(remove_duplicate=False)}
        for value in plan.buffer_values():
            entries.append(_Entry("buffer", names.get(id(value), "<buffer>"), value, tuple(value.shape), value.dtype))
    if grads:
        for name, p in zip(plan.names, plan.params, strict=True):
            entries.append(_Entry("gradient", name, p.grad, tuple(p.shape), p.dtype))
    return entries


def _optimizer_entries(optimizer: torch.optim.Optimizer, plan: Any) -> list[_Entry]:
    # The optimizer's state over the replicated parameters, by parameter and key, numbers as float64 tensors.
    entries = []
    for name, param in zip(plan.names, plan.params, strict=True):
        for key, value in sorted(optimizer.state.get(param, {}).items(), key=lambda item: str(item[0])):
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
            entries.append(_Entry("optimizer state", f"{name}.{key}", tensor, tuple(tensor.shape), tensor.dtype))
    return entries


def _gathered(values: list[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    # Every rank's ``values`` (int64s, as many on every rank), by rank.
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [row.tolist() for row in gathered]


def _different_lists(
    entries: Sequence[_Entry], descriptions: list[int], group: dist.ProcessGroup, device: torch.device
) -> Mismatch:
    # The ranks compare different tensors (names, shapes or dtypes): gather the lists to say where.
    mine = [(e.kind, e.name, e.shape, str(e.dtype)) for e in entries]
    lists = gather_objects(mine, group, device)
    reference = _reference_group(descriptions)
    ref = min(reference)
    others = tuple(r for r in range(len(descriptions)) if r not in reference)
    first = others[0]
    a, b = lists[first], lists[ref]
    where = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    seen = a[where] if where < len(a) else "nothing"
    expected = b[where] if where < len(b) else "nothing"
    name = f"entry {where}: rank {first} has {seen}, rank {ref} has {expected}"
    return Mismatch("tensor list", name, others, ref, float("nan"), 0, 0)


def _reference_group(values: Sequence[int]) -> set[int]:
    # The ranks holding the value most ranks hold; ties go to the group with the lowest rank.
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    largest: list[int] = max(groups.values(), key=lambda ranks: (len(ranks), -min(ranks)))
    return set(largest)


def _explain(
    entries: Sequence[_Entry],
    differing: Sequence[int],
    table: list[list[int]],
    group: dist.ProcessGroup,
    device: Optional[torch.device],
) -> tuple[Mismatch, ...]:
    # The second, agreed collective: every rank sends the differing tensors'
    # bytes (zeros for a missing gradient), so every rank builds the same report.
    pieces = [
        torch.zeros(e.shape, dtype=e.dtype).reshape(-1).view(torch.uint8) if e.tensor is None else _host_bytes(e.tensor)
        for e in (entries[i] for i in differing)
    ]
    packed = torch.cat(pieces).to(device) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(packed) for _ in table]
    dist.all_gather(gathered, packed, group=group)
    split = [t.cpu().split([p.numel() for p in pieces]) for t in gathered]  # [rank][differing tensor]
    return tuple(
        _compare(entries[i], [row[1 + i] for row in table], [s[k] for s in split]) for k, i in enumerate(differing)
    )


def _compare(entry: _Entry, digests: Sequence[int], values: Sequence[torch.Tensor]) -> Mismatch:
    # values: each rank's bytes of the tensor (uint8).
    reference = _reference_group(digests)
    ref = min(reference)
    others = tuple(r for r in range(len(digests)) if r not in reference)
    numel = math.prod(entry.shape)
    missing = [r for r in (ref, *others) if digests[r] == _NO_TENSOR]
    if missing:
        have = [r for r in (ref, *others) if digests[r] != _NO_TENSOR]
        note = f"no gradient on rank(s) {_listed(missing)}, a gradient on rank(s) {_listed(have)}"
        return Mismatch(entry.kind, entry.name, others, ref, float("inf"), numel, numel, (), note)
    element_size = torch.empty((), dtype=entry.dtype).element_size()
    ref_bytes = values[ref].reshape(numel, element_size)
    ref_values = _as_float64(values[ref], entry)
    worst: list[float] = []
    num_differing, first_index = 0, cast(tuple[int, ...], ())
    for rank in others:
        changed = (values[rank].reshape(numel, element_size) != ref_bytes).any(dim=1)
        num_differing = max(num_differing, int(changed.sum()))
        if not first_index and entry.shape and bool(changed.any()):
            flat_index = torch.tensor(int(changed.nonzero()[0, 0]))
            first_index = tuple(int(v) for v in torch.unravel_index(flat_index, entry.shape))
        if numel:
            worst.append(float((_as_float64(values[rank], entry) - ref_values).abs().max()))
    max_difference = float("nan") if any(w != w for w in worst) else max(worst, default=0.0)
    return Mismatch(entry.kind, entry.name, others, ref, max_difference, num_differing, numel, first_index)


def _as_float64(data: torch.Tensor, entry: _Entry) -> torch.Tensor:
    # A copy first: a slice of the gathered bytes may sit at an offset the dtype's view refuses.
    values = data.clone().view(entry.dtype).reshape(entry.shape)
    return values.to(torch.complex128 if values.is_complex() else torch.float64)


def _listed(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
