"""``replicate()``: the public entry point, and the methods it adds to a module."""

from __future__ import annotations

import contextlib
import copyreg
import functools
import inspect
from datetime import timedelta
from typing import Any, Iterable, Iterator, Optional, Union, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.hooks import RemovableHandle

from torchreplicate.compat.ddp_args import ddp_options, group_of, refuse_module
from torchreplicate.compat.ddp_surface import OWN_NAMES_WIN, DDPSurface
from torchreplicate.config import ReplicateConfig, to_device, to_ignored_modules
from torchreplicate.core.plan import ReplansOnConversion
from torchreplicate.core.registry import find_state, get_state, register_state, without_registry
from torchreplicate.core.state import ReplicateState
from torchreplicate.torch_internals import disable_join


class ReplicateModule(DDPSurface, ReplansOnConversion):
    """Methods every replicated module gains (its class becomes a subclass).

    ``replicate(model)`` sets ``model.__class__`` to a class deriving from this
    and from the model's own class, so ``isinstance(model, MyModel)`` holds.
    DDP's other attributes and methods come from ``DDPSurface`` (compat/ddp_surface.py);
    a conversion (``.to()``, ...) re-plans (``ReplansOnConversion``, [Note: re-planning] in core/plan.py).
    """

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Turns gradient averaging on (default) or off for the next backwards.

        Off, backward only accumulates local gradients (gradient accumulation);
        the first backward with it on again averages everything accumulated.
        The setting is read at backward time, so it may change between a
        forward and its backward.

        Args:
            requires_gradient_sync: True to average at the end of each backward.
        """
        get_state(self).set_requires_gradient_sync(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager: backwards inside it accumulate without averaging.

        Example::

            with model.no_sync():
                model(micro_batch_1).sum().backward()   # local only
            model(micro_batch_2).sum().backward()       # averages both
        """
        state = get_state(self)
        previous = state.requires_gradient_sync
        state.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            state.set_requires_gradient_sync(previous)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Reduces every bucket with ``hook(state, bucket)`` (DDP's comm-hook protocol).

        The stock hooks of ``torch.distributed.algorithms.ddp_comm_hooks`` work
        unchanged. Register once, before the first backward.

        Args:
            state: passed to the hook as its first argument (e.g. a process
                group, or a ``PowerSGDState``).
            hook: ``hook(state, bucket) -> torch.futures.Future[Tensor]``; the
                future's value becomes the bucket's averaged gradients.
        """
        get_state(self).register_comm_hook(state, hook)

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """A ``torch.distributed.algorithms.join.Join`` context for uneven inputs (DDP's ``join``).

        Ranks with fewer batches leave their loop and shadow the others'
        collectives until every rank is done; then every rank takes the
        parameters of the last rank to finish. See [Note: join] in core/join.py.

        Example::

            with model.join():
                for x, y in my_shard_of_the_data():   # a different length on each rank
                    loss_fn(model(x), y).backward()
                    optimizer.step(); optimizer.zero_grad()

        Args:
            divide_by_initial_world_size: divide by the initial world size
                (joined ranks count as zeros, DDP's default) or by the ranks
                still training. Default True.
            enable: False makes the context do nothing. Default True.
            throw_on_early_termination: raise on every rank as soon as one
                runs out, instead (needed when the forward runs collectives of
                its own, such as SyncBatchNorm). Default False.
        """
        return Join(
            [cast(Joinable, self)],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickles and deep-copies as a plain module of the original class.

        ``copy.deepcopy(model)`` (an EMA or teacher copy) and ``torch.save(model)``
        give an ordinary module: no hooks, no reducer, no collectives, the
        original untouched. Call ``replicate()`` on the copy to replicate it.
        """
        reduced = super().__reduce_ex__(protocol)
        state = find_state(self)
        if not isinstance(reduced, tuple) or reduced[0] is not _NEWOBJ or state is None:
            return reduced
        plain: type = type(self).original_class  # type: ignore[attr-defined]  # the class replicate() derived from
        attributes = reduced[2]
        if isinstance(attributes, dict):
            attributes = without_registry(_without_hooks(attributes, state.hook_handles))
            attributes.pop("_join_config", None)  # torch's Join protocol state, set by replicate()
        # Not copyreg.__newobj__: pickle insists that its class be type(self).
        return (plain.__new__, (plain,), attributes, *reduced[3:])


Joinable.register(ReplicateModule)  # torch's Join protocol, by duck typing (no ABC metaclass on modules)


@functools.lru_cache(maxsize=None)
def _replicated_class(cls: Any) -> type:
    # [Note: the replicated class's name] The subclass shows the model's own
    # ``__name__``: ``repr(model)``, logs and whatever records a model by its
    # class name (transformers' ``save_pretrained`` writes
    # ``type(model).__name__`` into config.json's "architectures", which
    # loaders dispatch on) see the model's class, as under DDP's ``.module``.
    # Its ``__qualname__`` keeps the ``Replicate`` prefix, so ``type(model)``
    # still prints as the subclass, and pickling the class by reference fails
    # instead of finding the original class.
    namespace = {"__module__": cls.__module__, "__qualname__": f"Replicate{cls.__qualname__}", "original_class": cls}
    for name in OWN_NAMES_WIN:  # the class's own wins ([Note: the model's own names win] in compat/ddp_surface.py)
        if hasattr(cls, name):
            namespace[name] = inspect.getattr_static(cls, name)
    return type(cls.__name__, (ReplicateModule, cls), namespace)


_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # what object.__reduce_ex__(2) returns; not in typeshed


def _without_hooks(attributes: dict[str, Any], handles: tuple[RemovableHandle, ...]) -> dict[str, Any]:
    # A shallow copy of a module's __dict__ whose hook dicts lack the hooks of
    # `handles`: what a deep copy or a pickle of a replicated module holds.
    drop: dict[int, set[Any]] = {}  # id(hook dict) -> our keys in it
    for handle in handles:
        for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
            hooks = ref()
            if hooks is not None:
                drop.setdefault(id(hooks), set()).add(handle.id)
    copied = dict(attributes)
    for name, value in attributes.items():
        if isinstance(value, dict) and id(value) in drop:
            kept = type(value)()
            kept.update((k, v) for k, v in value.items() if k not in drop[id(value)])
            copied[name] = kept
    return copied


def replicate(
    module: nn.Module,
    *positional: Any,
    ignored_modules: Optional[Iterable[nn.Module]] = None,
    device_id: Union[int, torch.device, None] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    mesh: Optional[DeviceMesh] = None,
    device_mesh: Optional[DeviceMesh] = None,
    bucket_cap_mb: Optional[float] = None,
    first_bucket_cap_mb: Optional[float] = None,
    bucket_layout: str = "learned",
    graph: str = "learned",
    tied_split: Optional[bool] = None,
    gradient_as_bucket_view: Optional[bool] = None,
    broadcast_buffers: Optional[bool] = None,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    reduce_dtype: Optional[torch.dtype] = None,
    gradient_divide_factor: Optional[float] = None,
    stall_timeout: Union[float, timedelta, None] = 60.0,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    **ddp_arguments: Any,
) -> nn.Module:
    """Makes ``module`` a data-parallel replica, in place, and returns it.

    After every ``backward()``, each replicated parameter's ``.grad`` is the
    mean of all ranks' gradients. The module keeps its identity, its
    ``state_dict`` keys and its behaviour; its class becomes a subclass that
    adds ``set_requires_gradient_sync``, ``no_sync``, ``register_comm_hook`` and ``join``.
    Parameters are checked across ranks and broadcast from rank 0 here; if
    ``fully_shard`` is applied to children afterwards, the first forward
    re-plans without them. Call on every rank, after ``init_process_group``.
    Where torch's own ``replicate`` or DDP refuses an input, the exception is
    of their type too and their message comes first ([Note: the seed's
    contract] in errors.py).

    Args:
        module: the model; its parameters must be the same on every rank.
        ignored_modules: modules whose parameters and buffers (and those of
            their descendants) are left alone. Default none.
        device_id: an ``int`` (accelerator index; the CPU where there is no
            accelerator) or a ``torch.device`` to move the module to first.
            Default: leave it where it is.
        process_group: the group to average over. Default: the world group.
        mesh: instead of ``process_group``, a 1-D ``DeviceMesh`` whose group
            is averaged over: with tensor parallelism, the data-parallel
            slice of the 2-D mesh (``mesh["dp"]``); DTensor parameters on
            the other dimension are averaged shard by shard and stay
            DTensors. Default: none (the world group).
        device_mesh: the same as ``mesh``, under DDP's name.
        bucket_cap_mb: gradients travel in buckets of about this many MiB.
            Default None: DDP's 25 (with ``bucket_layout="tuned"``: chosen
            from the link, measured in the first step).
        first_bucket_cap_mb: cap of the first bucket to leave in backward.
            Default None: DDP's rule, 1 MiB where ``bucket_cap_mb`` is left
            at its default, else ``bucket_cap_mb`` itself (the opt-in
            layouts: 1 MiB).
        bucket_layout: ``"learned"`` (default): DDP's buckets and DDP's arithmetic, so the same
            seeded job ends with DDP's bits at any number of ranks: the first synchronised step
            reduces one bucket per dtype and device, later ones the buckets DDP rebuilds in the
            order gradients became ready ([Note: DDP's buckets] in reducer/layout/plan.py). As under DDP,
            a run resumed from a checkpoint then differs from an uninterrupted one in the last
            bits at 3+ ranks (its first step is laid out otherwise). ``"fixed"``: one layout from
            the first step on, reverse registration order at the caps (DDP's 25 MiB, 1 MiB
            first, unless given), never rebuilt: a resumed run, or a replica that joins later
            (torchft), gets the bits of an uninterrupted one, not DDP's. ``"tuned"`` (opt-in,
            like ``torch.backends.cudnn.benchmark``): also times the link in the first step and
            chooses the cap and the bucket ends from those timings, and reduces a tied
            parameter's uses apart (its embedding's rows after the buckets) where that pays;
            faster where the network is slower than compute, but the timings decide which
            gradients are summed together, so a rerun can differ in the last bits. Refused under
            ``torch.use_deterministic_algorithms(True)`` (a warning with ``warn_only=True``). See
            reducer/layout/policy.py's [Note: tuning].
        graph: ``"learned"`` (default): the first synchronised step learns how
            often each parameter's gradient arrives; later steps read the
            summed flags one step late, so a step makes no host read (on a
            GPU, no synchronisation); a desync is then named one step later,
            and a gradient arriving more often than learned, after its bucket
            left, raises at the next step instead of being reduced.
            ``"dynamic"``: the flags are read at the end of every step (one
            host read per step), and such gradients are reduced by a late
            round at any step. Unused parameters work either way. See
            reducer/flags.py's [Note: flags read a step late].
        tied_split: reduce a tied parameter's first use (a GPT's token
            embedding, tied to its LM head) apart, by the rows its batch
            touched, so the parameter's bucket leaves during backward instead
            of at its end: faster where the link is the step, but not DDP's
            bits (DDP reduces the parameter whole). Default None: only under
            ``bucket_layout="tuned"``, where its first step finds it pays;
            True: always (the same on every run); False: never. See
            reducer/tied_rows.py's [Note: tied parameters].
        gradient_as_bucket_view: where ``.grad`` lives, with DDP's arithmetic
            for the same argument. Default None: each ``.grad`` is a view
            into its bucket (no second copy of the gradients), summed with
            DDP's default arithmetic (every gradient multiplied by 1 / world
            size on its way into the bucket). True: views too, with DDP's
            arithmetic for ``gradient_as_bucket_view=True`` (a ``.grad``
            that already is its view, under ``zero_grad(set_to_none=False)``,
            is divided in place, as DDP's). False: ``.grad`` kept apart and
            copied, as DDP's default.
        broadcast_buffers: give every rank rank 0's buffers (e.g. BatchNorm
            statistics) at set-up and before forwards, by DDP's rules
            ([Note: buffer sync] in core/buffers.py); False: never, not even
            at set-up (DDP's ``forward_sync_buffers=False`` keeps the set-up
            broadcast). Default None: True (DDP 2.13's default spelling).
        find_unused_parameters: unused parameters are always handled (no
            rank needs this to train); True lays the buckets out as DDP
            does for it (registration order, never rebuilt), so the job
            keeps DDP's bits. Default False.
        static_graph: the graph is always learned; True rebuilds the
            buckets from the second step's order, as DDP does for it, so
            the job keeps DDP's bits. Default False.
        reduce_dtype: dtype gradients travel in (e.g. ``torch.bfloat16``,
            half the bytes); results are written back in the parameters'
            dtype. Default None: the parameters' own dtype.
        gradient_divide_factor: the reduced sum is divided by this. Default
            None: the world size (a mean). 1 gives a sum, for losses normalised
            by a global token count (docs/modern-stack.md).
        stall_timeout: seconds (or a ``timedelta``) a reducer collective
            waits before the waiting rank looks at the others' notes (then
            again at doubling intervals): a rank alive outside the step
            (saving a checkpoint, evaluating alone) draws a ``StallWarning``
            naming it, and the collective waits on up to the process
            group's own timeout, as DDP's; a rank gone, or waiting in
            another collective, makes it raise at once, naming who is where
            ([Note: stall watchdog] in faults/watchdog.py). Default 60; None turns the watchdog off.
        mp_policy: torch's ``torch.distributed.fsdp.MixedPrecisionPolicy``:
            compute in ``param_dtype`` with fp32 master weights and
            gradients, reduce in ``reduce_dtype`` (default ``param_dtype``,
            as FSDP2), inputs cast when ``cast_forward_inputs``, outputs
            cast to ``output_dtype`` (see core/mixed_precision.py). Default None.
        **ddp_arguments: the rest of DDP's constructor, with DDP's meaning
            (``device_ids=[local_rank]``, ``output_device``, ``init_sync``,
            ``forward_sync_buffers``, ...): mapped onto the options above, or
            refused saying why and what to write (see compat/ddp_args.py). Options
            are keyword-only: a positional one is refused, naming its keyword.
            ``init_sync=False`` keeps each rank's own parameters and buffers
            (shapes are still checked across ranks).

    Returns:
        ``module`` itself.

    Raises:
        RuntimeError: ``module`` is managed by ``fully_shard``, ``replicate``
            was already applied, or the ranks' parameters differ (raised on
            every rank, naming the parameter).
        TypeError / ValueError: an option has a bad value (the message names
            the option, the value and the fix).

    Note:
        - ``model.module`` is a view of the model, not a second object: the same
          parameters, buffers, hooks and ``state_dict`` keys as DDP's
          ``ddp.module``, with none of DDP's attributes (unwrapping loops end).
          A forward through it is the replicated forward, collectives included,
          where DDP's ``ddp.module(x)`` bypasses DDP.
        - ``.grad`` holds the mean over ranks after ``backward()`` returns. During
          backward, at the default layout, a parameter's ``.grad`` is ``None``
          while its bucket is in flight. A post-accumulate-grad hook on a
          replicated parameter is refused (ours is its one such hook): use
          ``register_comm_hook``, or read ``.grad`` after ``backward()``.
        - At default options a seeded job ends with DDP's bits. What changes
          them: ``bucket_layout="tuned"`` or ``"fixed"``, ``tied_split``,
          ``reduce_dtype``, ``mp_policy``, ``gradient_divide_factor`` and a comm
          hook's own arithmetic (docs/migration.md, DDP's bits).
        - Every rank runs the same sequence of forwards with gradients,
          backwards and optimizer steps. A forward without gradients
          (``torch.no_grad()``, evaluation) runs no collective, so one rank may
          evaluate alone.
        - Side effects, while a replicated module lives: torch's global
          module-registration hooks and one optimizer-step post-hook, a
          heartbeat thread (the stall watchdog), and exit handlers. Nothing is
          drawn from a random generator the user can see.

    Warning:
        - A change to the model (freezing, new parameters, ``.to()``, a dtype)
          must be made on every rank at the same step: the next forward
          re-plans on every rank; a change on some ranks only raises, or with
          gloo may abort.
        - ``copy.deepcopy(model)`` and ``torch.save(model)`` give a plain module
          of the original class, not a replica.
        - A backward that raised on some ranks only (a caught out-of-memory
          error) makes every rank raise at the flags' next read: resume every
          rank from a checkpoint.
        - No GPU has run this code: the CUDA and NCCL paths are read from
          torch's sources and tested with fakes on the CPU.
    """
    options = ddp_options(
        module,
        positional,
        ddp_arguments,
        OWN_OPTIONS,
        device_id=device_id,
        broadcast_buffers=broadcast_buffers,
        bucket_cap_mb=bucket_cap_mb,
    )
    process_group = group_of(process_group, mesh, device_mesh)
    config = ReplicateConfig(
        ignored_modules=to_ignored_modules(ignored_modules),
        device_id=to_device(options["device_id"]),
        bucket_cap_mb=options["bucket_cap_mb"],
        first_bucket_cap_mb=first_bucket_cap_mb,
        bucket_layout=bucket_layout,
        graph=graph,
        tied_split=tied_split,
        gradient_as_bucket_view=gradient_as_bucket_view,
        broadcast_buffers=options["broadcast_buffers"],
        init_sync_buffers=options["init_sync_buffers"],
        dim=options["dim"],
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        reduce_dtype=reduce_dtype,
        gradient_divide_factor=gradient_divide_factor,
        stall_timeout=stall_timeout,
        mp_policy=mp_policy,
    )
    refuse_module(module, config.ignored_modules, config.device_id)
    return _attach_state(module, config, process_group, keep_local_values=not options["init_sync"])


replicate.state = get_state  # type: ignore[attr-defined]
OWN_OPTIONS = tuple(name for name, p in inspect.signature(replicate).parameters.items() if p.kind is p.KEYWORD_ONLY)


def _attach_state(
    module: nn.Module, config: ReplicateConfig, process_group: Optional[dist.ProcessGroup], *, keep_local_values: bool
) -> nn.Module:
    # Registers the module's state in torch's registry ([Note: the registry] in
    # core/registry.py) and runs its set-up there (all undone if that fails):
    # then the module is a ReplicateModule; returns it.
    state = ReplicateState(module, config, process_group)

    def set_up() -> None:
        # DDP's init_sync=False: each rank keeps its own parameters and buffers. The set-up still checks
        # shapes across ranks and broadcasts (every rank runs the same collectives, whatever each passed);
        # this copy is put back after it. By name: a device_id move replaces the buffers' tensors.
        kept = {name: t.detach().clone() for name, t in _named_tensors(module).items()} if keep_local_values else {}
        try:
            state.init()
        except BaseException:
            state.remove_hooks()
            raise
        with torch.no_grad():
            named = _named_tensors(module)
            for name, value in kept.items():
                named[name].copy_(value)
        module.__class__ = _replicated_class(type(module))  # type: ignore[arg-type]  # mypy: Module.__hash__ is not Hashable
        disable_join(module)  # torch's join config, disabled until a Join

    register_state(module, state, state.clock, set_up)
    return module


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}
