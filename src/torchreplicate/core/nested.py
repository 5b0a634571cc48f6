"""Replicated modules inside one another, and next to ``fully_shard``.

[Note: nested replicate]
Applied per block and then to the root (as torchtitan applies data
parallelism), every parameter is reduced once, by the outermost module's
reducer, in one collective sequence (rank-dependent graphs stay exact): the
inner modules give up their reducers and forward work, and their parameters
travel in buckets of their own. The nested modules must agree on how
gradients are reduced.

Refused: ``replicate()`` on a module inside one it was already applied to
(apply it to the blocks first; api.py refuses it), and on a module inside
one ``fully_shard`` manages, which already reduces its gradients (here,
called by api.py). Children that ``fully_shard`` manages are left to it (the
plan skips them).

[Note: replicate under fully_shard]
The other order works: ``replicate(child)`` and then ``fully_shard(root)``.
``replicate()`` registered the child in torch's registry ([Note: the
registry] in core/registry.py), so ``fully_shard`` leaves the child's
subtree out of its groups, as it does for torch's own ``replicate``: the
child's gradients are ours to average, the rest ``fully_shard``'s, each
reduced once. So the refusal above is checked once, at ``replicate()``: a
module that enclosing ``fully_shard`` finds registered is one it skips.
tests/test_nested.py trains that nesting beside torch's own ``replicate``.
"""

from __future__ import annotations

from torch import nn

from torchreplicate.config import ReplicateConfig
from torchreplicate.core.registry import find_state
from torchreplicate.torch_internals import fully_sharded_modules

# What decides how a parameter is reduced: nested modules must agree on it.
REDUCTION_OPTIONS = ("gradient_as_bucket_view", "broadcast_buffers", "wire_dtype", "gradient_divide_factor")


def class_name(module: nn.Module) -> str:
    """The module's class name as the user wrote it (not replicate()'s subclass)."""
    return getattr(type(module), "original_class", type(module)).__name__


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether PyTorch's ``fully_shard`` (FSDP2) manages ``module``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def refuse_inside_fully_shard(module: nn.Module) -> None:
    """Raises RuntimeError if ``module`` is inside another module that ``fully_shard`` manages.

    Called by ``replicate()`` before it registers ``module``: a ``fully_shard``
    applied to an enclosing module later skips it ([Note: replicate under
    fully_shard]).
    """
    for sharded in fully_sharded_modules():
        if sharded is not module and any(m is module for m in sharded.modules()):
            raise RuntimeError(
                f"replicate(): this {class_name(module)} is inside a {type(sharded).__name__} "
                "managed by fully_shard, which already reduces its gradients; replicate() would "
                "average them a second time. Apply replicate() first and fully_shard to the "
                "enclosing module after (it then skips this one), or fully_shard to children and "
                "replicate() to the root, or only one of them"
            )


def replicated_inside(module: nn.Module) -> list[nn.Module]:
    """The replicated modules inside ``module`` (``replicate()`` applied to them), outermost first."""
    return [m for m in module.modules() if m is not module and find_state(m) is not None]


def check_same_reduction(inner: ReplicateConfig, outer: ReplicateConfig, inner_name: str, outer_name: str) -> None:
    """Raises ValueError where ``inner`` and ``outer`` (of the modules so named) differ in a ``REDUCTION_OPTIONS``."""
    for option in REDUCTION_OPTIONS:
        mine, theirs = getattr(inner, option), getattr(outer, option)
        if mine != theirs:
            raise ValueError(
                f"replicate(): nested replicate() calls disagree on {option} ({inner_name}: "
                f"{mine}, the enclosing {outer_name}: {theirs}); the outermost reduces "
                "every parameter in one collective sequence, so pass the same options to both"
            )
