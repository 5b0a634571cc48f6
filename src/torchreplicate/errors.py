"""Error messages (cross-rank problems, refused patterns): plain functions, tested alone."""

from __future__ import annotations

import warnings
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch

ParamDescription = Sequence[tuple[str, tuple[int, ...], str]]


def format_param_mismatch(per_rank: Sequence[ParamDescription], this_rank: int) -> str:
    """Explains how the ranks' parameters differ, naming the first difference.

    Args:
        per_rank: each rank's list of (fully qualified name, shape, dtype).
        this_rank: the rank raising, named in the message.
    """
    counts = [len(d) for d in per_rank]
    head = (
        f"replicate(): rank {this_rank}: the ranks hold different parameters, so their gradients cannot be averaged. "
    )
    fix = " Build the same model on every rank before calling replicate()."
    width = min(counts)
    for position in range(width):
        entries = [d[position] for d in per_rank]
        if len(set(entries)) == 1:
            continue
        if len({name for name, _, _ in entries}) > 1:
            listing = ", ".join(f"rank {r}: {e[0]!r}" for r, e in enumerate(entries))
            return f"{head}Parameter #{position} has different names: {listing}.{fix}"
        listing = ", ".join(f"rank {r}: shape {list(shape)} {dtype}" for r, (_, shape, dtype) in enumerate(entries))
        return f"{head}Parameter {entries[0][0]!r} differs: {listing}.{fix}"
    listing = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    extra = [f"rank {r} also has {d[width][0]!r}" for r, d in enumerate(per_rank) if len(d) > width]
    return f"{head}Different numbers of parameters ({listing}); {'; '.join(extra)}.{fix}"


def format_option_mismatch(per_rank: Sequence[dict[str, str]], this_rank: int) -> str:
    """Names the first ``replicate()`` option the ranks disagree on ('' if none).

    Args:
        per_rank: each rank's options that decide the collectives.
        this_rank: the rank raising, named in the message.
    """
    for option in sorted({key for options in per_rank for key in options}):
        values = [options.get(option) for options in per_rank]
        if len(set(values)) > 1:
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            return (
                f"replicate(): rank {this_rank}: the ranks called replicate() with different "
                f"{option} ({listing}), so their buckets would not match. Pass the same options "
                "on every rank"
            )
    return ""


class DesyncReport(NamedTuple):
    """What each rank tells the others after the flags said the ranks disagree.

    Attributes:
        rank: the group rank.
        clock: optimizer steps it took over the module's parameters.
        layout_digest: a digest of its bucket layout.
    """

    rank: int
    clock: int
    layout_digest: int


def describe_error(error: BaseException) -> str:
    """An exception in one line, for the note others' errors name: "ValueError: a bad sample"."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


class AgreedError(RuntimeError):
    """An error every rank raises at the same point of its collective sequence, from sums every rank
    read alike (the flags: a desync, a step that raised on some ranks, a late gradient)."""


class StepRaisedError(AgreedError):
    """A step raised on some ranks but not all (``backward_raised_error``): every rank raises it at the
    same read of the flags, after one more agreed collective that brings every training clock to the
    highest (the ranks that raised skipped an optimizer step), so the group goes on after a checkpoint."""


def desync_error(reports: Sequence[DesyncReport], rank: int, backward: int, clocks_agree: bool) -> AgreedError:
    """The error every rank raises once the flags said the ranks disagree, from every rank's report
    (gathered by one more agreed collective: [Note: desync detection] in flags.py).

    Args:
        reports: every rank's ``DesyncReport``, in rank order.
        rank: this rank.
        backward: synchronised backwards this rank completed before this one.
        clocks_agree: whether the training clocks agreed (else the layouts differ).
    """
    return AgreedError(format_desync(reports, rank, backward, clocks_agree))


def some_names(names: Sequence[str], at_most: int = 4, quote: bool = True) -> str:
    """The first few distinct names, and how many more: "'a', 'b' and 3 more" (every message's list).

    Args:
        names: the names, in order; repeats are shown once.
        at_most: how many to show. Default 4.
        quote: show each as its ``repr`` (True, default) or as it is.
    """
    distinct = list(dict.fromkeys(names))
    more = f" and {len(distinct) - at_most} more" if len(distinct) > at_most else ""
    return ", ".join(map(repr, distinct[:at_most]) if quote else distinct[:at_most]) + more


def late_after_learning(rank: int, step: int, late_ranks: int, late_params: Sequence[str]) -> RuntimeError:
    """The error every rank raises a step after a gradient came late under ``graph="learned"``.

    Args:
        rank: this rank.
        step: the synchronised step that had the late gradients.
        late_ranks: how many ranks had one.
        late_params: the parameters that had one on this rank (none: another rank's).
    """
    here = f"here: {some_names(late_params)}" if late_params else "none here"
    return AgreedError(
        f"replicate(): rank {rank}: synchronised backward {step}: on {late_ranks} rank(s) a gradient arrived "
        f"after its bucket was reduced ({here}), more often than in the step the reducer learned from, so "
        'that step\'s average missed it; the graph changed. Pass replicate(..., graph="dynamic") to reduce '
        "such gradients at any step (the summed flags are then read at the end of every step), or keep "
        "the number of times each parameter's gradient is accumulated per backward the same at every step"
    )


def backward_raised_error(
    rank: int, step: int, raised: int, rank_sum: int, what: Optional[Mapping[int, str]] = None
) -> RuntimeError:
    """The error every rank raises where a step raised on some ranks but not all ([Note: a backward
    that raised] in reducer.py): ``raised`` ranks, whose ranks sum to ``rank_sum``; ``what``: what each
    raising rank noted it raised (the stall watchdog's notes), by rank."""
    where = f"rank {rank_sum}" if raised == 1 else f"{raised} ranks"
    said = "; ".join(f"rank {r}: {text}" for r, text in sorted((what or {}).items()))
    return StepRaisedError(
        f"replicate(): rank {rank}: synchronised step {step} raised on {where}"
        + (f" ({said})" if said else " (out of memory, an exception in the forward or a hook)")
        + " and ended on the others, so that step's average misses the gradients of "
        f"{where}, and any optimizer step after it used that average. Every rank raises here, at the same "
        "collective; the process group stays usable. Resume every rank from the last checkpoint (torchrun "
        "--max-restarts), or let the ranks handle the exception alike (all raise, then the step is dropped)"
    )


def warn_late_unreduced(step: int, late_params: Sequence[str]) -> None:
    """Warns, on the rank that had it, that a late gradient is missing from the average (``graph="learned"``)."""
    warnings.warn(
        f"replicate(): synchronised backward {step}: the gradient of {some_names(late_params)} "
        "arrived after its bucket was reduced, more often than in the step the reducer learned from; this "
        'step\'s average misses it, and every rank raises at the end of the next step (graph="dynamic" '
        "reduces such gradients)",
        UserWarning,
        stacklevel=2,
    )


def format_desync(reports: Sequence[DesyncReport], this_rank: int, backward: int, clocks_agree: bool) -> str:
    """Explains a desync ([Note: desync detection] in flags.py), naming the ranks.

    Args:
        reports: every rank's report, by rank.
        this_rank: the rank raising.
        backward: synchronised backwards this rank completed before this one.
        clocks_agree: whether the training clocks agreed (else the layouts differ).
    """
    head = f"replicate(): rank {this_rank}: synchronised backward {backward}: "
    if not clocks_agree:
        by_clock: dict[int, list[int]] = {}
        for report in reports:
            by_clock.setdefault(report.clock, []).append(report.rank)
        listing = ", ".join(
            f"{_ranks(ranks)} at step {clock}" for clock, ranks in sorted(by_clock.items(), reverse=True)
        )
        return (
            f"{head}the ranks are at different training steps ({listing}; steps counted as optimizer "
            "steps over this module's parameters): a rank ran an extra backward or skipped one, so "
            "gradients of different steps were being averaged together. Every rank must run the same "
            "sequence of forward, backward and optimizer.step()"
        )
    by_layout: dict[int, list[int]] = {}
    for report in reports:
        by_layout.setdefault(report.layout_digest, []).append(report.rank)
    groups = "; ".join(_ranks(ranks) for ranks in by_layout.values())
    return (
        f"{head}the ranks' bucket layouts differ (same layout within: {groups}): the replicated "
        "parameters changed on some ranks only (a layer frozen, unfrozen, added or converted). "
        "Make the same change on every rank, at the same step"
    )


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def foreign_hook_error(name: str) -> ValueError:
    """The error for a post-accumulate-grad hook on a replicated parameter that is not the reducer's.

    Args:
        name: the parameter's fully qualified name.
    """
    return ValueError(
        f"replicate(): parameter {name!r} has a post-accumulate-grad hook registered "
        "by someone else; it would run on this rank's local gradient before the average, or "
        "find .grad already moved into its bucket (an optimizer stepped there makes the "
        "replicas diverge or never steps). For an optimizer in backward use "
        "torch.distributed.optim._apply_optimizer_in_backward, which replicate() steps after "
        "the average; otherwise step after backward()"
    )


def changed_since_plan(name: str, shape: torch.Size, grad: torch.Tensor, buffer: torch.Tensor) -> RuntimeError:
    """The error for a gradient whose dtype, device, shape or layout no longer fits its slot.

    Args:
        name: the parameter's fully qualified name.
        shape: the parameter's shape, as planned.
        grad: the gradient that does not fit.
        buffer: the bucket's memory the gradient was planned into.
    """
    if grad.is_sparse:
        return RuntimeError(
            f"replicate(): parameter {name!r} was planned for dense gradients but got a sparse "
            "one; set the module's sparse flag (nn.Embedding(sparse=True)) before replicate() and keep it"
        )
    return RuntimeError(
        f"replicate(): parameter {name!r} changed since it was planned: its gradient is "
        f"{grad.dtype} {tuple(grad.shape)} on {grad.device}, its bucket holds {buffer.dtype} "
        f"{tuple(shape)} on {buffer.device}. Convert the whole replicated model "
        "(model.to(...), model.double(), ...: replicate() re-plans) or convert before replicate()"
    )


def complex_wire_error(name: str, dtype: torch.dtype, wire_dtype: torch.dtype) -> ValueError:
    """The refusal of a complex gradient that would travel in a real wire dtype (the imaginary part lost)."""
    return ValueError(
        f"replicate(): parameter {name!r} is complex ({dtype}), and its gradient cannot travel in "
        f"reduce_dtype={wire_dtype}: a real dtype drops the imaginary part. Drop reduce_dtype (or the "
        "mp_policy's reduce_dtype), or pass the module that holds the parameter in ignored_modules"
    )


def warn_create_graph() -> None:
    """Warns that backward(create_graph=True) averages values, not graphs (once per process: one call site)."""
    warnings.warn(
        "replicate(): backward(create_graph=True): each .grad holds the average over ranks, "
        "without the graph of the local gradient (as DDP); higher-order terms through .grad "
        "are not averaged. torch.autograd.grad(..., create_graph=True) is unaffected",
        UserWarning,
        stacklevel=2,
    )


def warn_forward_raised(step: int) -> None:
    """Warns that a synchronised forward raised on this rank, so it ran its step's collectives with zeros
    ([Note: a backward that raised] in reducer/reducer.py)."""
    warnings.warn(
        f"replicate(): the forward of synchronised step {step} raised on this rank; the collectives the "
        "other ranks run after their forward (the buffers for the next one, the gradient buckets, the flags) "
        "ran here with zeros and flags that say so, so every rank's collective sequence stays paired. Where "
        "it raised on every rank, training goes on; else every rank raises at the flags' next read, naming "
        "this rank and what it raised",
        UserWarning,
        stacklevel=2,
    )


def warn_backward_raised(step: int) -> None:
    """Warns that a synchronised backward raised, so its gradients were cleared ([Note: a backward that raised])."""
    warnings.warn(
        f"replicate(): the synchronised backward of step {step} raised before it ended; its "
        "collectives were completed and every replicated parameter's .grad was set to None here "
        "(the partial sums are neither this rank's gradients nor the average), as "
        "zero_grad(set_to_none=True) would; gradients accumulated before it (no_sync) are dropped too. "
        "Where it raised on every rank, training goes on; else every rank raises at the flags' next read",
        UserWarning,
        stacklevel=2,
    )


def raise_with_place(error: Exception, where: str) -> None:
    """Re-raises a comm hook's protocol error prefixed with where it happened.

    Only plain TypeError and ValueError are rebuilt: a subclass may not take a
    single message argument, so it is re-raised as it is.
    """
    if type(error) in (TypeError, ValueError):
        raise type(error)(f"{where}: {error}") from None
    raise error


def ddp_on_top_error(what: str, wrapper: str, rank: int) -> RuntimeError:
    """A replicated module run by ``DistributedDataParallel``'s forward: DDP and replicate() would both average.

    Args:
        what: the replicated module, as the message names it (its class).
        wrapper: the DDP instance's wrapped module, as the message names it.
        rank: this rank in the world.
    """
    return RuntimeError(
        f"replicate(): rank {rank}: this {what} was replicated and is now run by "
        f"torch.nn.parallel.DistributedDataParallel (wrapping {wrapper}): DDP and replicate() would each "
        "average every gradient, twice the all-reduces and the wrong gradients. replicate() already makes "
        "the model data-parallel: use it without the DDP wrapper. Under Hugging Face accelerate or "
        "transformers.Trainer, which wrap it for you: torchreplicate.integrations.accelerate "
        "(prepare_model, ReplicateAccelerator, ReplicateTrainer), or accelerator.prepare_model(model, "
        "evaluation_mode=True), which prepares the model without the DDP wrap. Under Ray Train, whose "
        "ray.train.torch.prepare_model wraps it: torchreplicate.integrations.ray.prepare_model(model) "
        "instead of replicate() and Ray's, or Ray's with parallel_strategy=None"
    )


def compiled_hook_error() -> RuntimeError:
    """The error for a comm hook under compiled autograd (raised before the forward, on every rank)."""
    return RuntimeError(
        "replicate(): a comm hook cannot run under compiled autograd (the backward is one traced "
        "graph: no futures, no per-bucket calls); turn torch._dynamo.config.compiled_autograd off, "
        "or drop the hook (replicate(reduce_dtype=...) sends the gradients in a lower precision)"
    )


def graph_capture_error(model: str, what: str = "forward") -> RuntimeError:
    """The error for a ``what`` ("forward", "backward") under CUDA-graph capture, raised before its collectives.

    torch.compile's ``mode="reduce-overhead"`` captures inductor's graphs only; replicate()'s hooks run
    between them, uncaptured, so it is not refused (the message says so, for a user who wonders).
    """
    return RuntimeError(
        f"replicate(): a {what} of the replicated {model} ran under CUDA-graph capture (torch.cuda.graph or "
        "make_graphed_callables around the forward or the backward), which replicate() does not support: its "
        "reducer launches collectives from gradient hooks and reads their flags on the host; capture the "
        "model's inner modules, not the replicated step, or run the step uncaptured (torch.compile's "
        "mode='reduce-overhead' is not refused: it captures inductor's graphs only, and replicate()'s hooks "
        "run between them)"
    )


# -- What torch's own replicate (the seed) and DDP's constructor say when they refuse ---
#
# What torch's own ``replicate`` (the seed) and DDP's constructor say when they refuse.
#
# [Note: the seed's contract] Where the seed (``torch/distributed/_composable/
# replicate.py``, which builds a ``DistributedDataParallel`` at the first
# forward) refuses an input that ``replicate()`` refuses too, ours raises an
# exception of the seed's type and puts the seed's (or DDP's) message first, our
# clearer text after it, so code and tests that catch the seed's exception or
# match its text keep working. Where the seed's type and ours differ, the
# exception class here subclasses both. The texts are checked against torch
# 2.13 by tests/test_seed_contract.py, which runs the seed beside ours.


class DeviceIdError(TypeError, ValueError, RuntimeError):
    """A bad ``device_id``: a ``TypeError``/``ValueError`` (ours) and a ``RuntimeError`` (the seed's).

    The seed raises ``RuntimeError`` for a ``device_id`` that is neither an
    ``int`` nor a ``torch.device``, and DDP ``ValueError`` for an index it
    cannot use; ours raises this, which is all three.
    """


class AlreadyReplicatedError(RuntimeError, AssertionError):
    """``replicate()`` applied twice to one module: the seed's ``AssertionError`` and ours' ``RuntimeError``."""


class GroupOptionError(ValueError, RuntimeError):
    """Conflicting or malformed group options: ours' ``ValueError`` and DDP's ``RuntimeError``."""


def seed_device_id_text(device_id: object) -> str:
    """The seed's message for a ``device_id`` that is neither an int nor a torch.device.

    Args:
        device_id: the value given.
    """
    return f"Expected device_id to be int or torch.device, but got {type(device_id)}"


def seed_applied_twice_text(module: object) -> str:
    """The seed's (its ``contract`` decorator's) message for a second ``replicate()`` on one module.

    Args:
        module: the module, printed as the seed prints it.
    """
    return (
        "Each distinct composable distributed API can only be applied to a module once. "
        f"replicate has already been applied to the following module:\n{module}"
    )


def not_iterable_text(value: object) -> str:
    """Python's message for iterating a non-iterable, which the seed raises for a bad ``ignored_modules``.

    Args:
        value: the value given.
    """
    return f"{type(value).__name__!r} object is not iterable"


DDP_BOTH_GROUPS_TEXT = "Cannot specify both process_group and device_mesh arguments."
DDP_ONE_DEVICE_TEXT = "device_ids can only be None or contain a single element."
DDP_DELAY_PAIR_TEXT = "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time."


def ddp_mesh_dims_text(mesh: Any) -> str:
    """DDP's message for a ``device_mesh`` that is not 1-D.

    Args:
        mesh: the ``DeviceMesh`` given.
    """
    return f"Only 1D device mesh is supported, but got {mesh}."


def ddp_device_types_text(device_types: set[str]) -> str:
    """DDP's message for a module whose parameters lie on more than one device type.

    Args:
        device_types: the device types, e.g. ``{"cpu", "meta"}``.
    """
    return (
        "DistributedDataParallel's input module must be on the same type of devices, "
        f"but input module parameters locate in {device_types}."
    )
