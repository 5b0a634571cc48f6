"""Set-up collectives: the cross-rank parameter check; what a failed collective was.

Plain ``@torch.no_grad()`` functions over explicit arguments. Each is called
at the same point on every rank, so each rank launches the same collectives.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from torchreplicate.errors import format_option_mismatch, format_param_mismatch
from torchreplicate.faults.wire import Watch, all_gather, digest, gather_objects
from torchreplicate.reducer.dtensors import describe_placement


def describe_params(names: Sequence[str], params: Sequence[torch.Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each parameter: what every rank must agree on."""
    return [(name, tuple(p.shape), _dtype_text(p)) for name, p in zip(names, params, strict=True)]


def _dtype_text(param: torch.Tensor) -> str:
    text = str(param.dtype).replace("torch.", "") + describe_placement(param)
    return text if param.requires_grad else text + " (frozen)"


def fingerprint(
    description: Sequence[tuple[str, tuple[int, ...], str]], options: Optional[dict[str, str]] = None
) -> int:
    """A 64-bit digest of a parameter description (and options), equal iff they are (but for collisions)."""
    return digest(repr((list(description), sorted((options or {}).items()))).encode())


@torch.no_grad()
def verify_params_across_ranks(
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device,
    options: Optional[dict[str, str]],
    watch: Watch,
) -> None:
    """Checks that every rank holds the same parameters (names, shapes, dtypes) and options.

    One all-gather of a digest on the happy path. On a mismatch, every rank
    has seen it in the gathered digests, so every rank gathers the full
    descriptions (a second, agreed collective) and raises the same error.

    Args:
        names: the parameters' fully qualified names.
        params: the parameters.
        group: the process group.
        device: where the digest travels (the group's backend device).
        options: ``replicate()`` options that decide the collectives (bucket
            caps, wire dtype); ranks that differ there would send buckets of
            different sizes, which gloo answers by aborting the process.
        watch: waits the digests' all-gather (the module's: the stall watchdog at a re-plan, or plain).

    Raises:
        RuntimeError: on every rank, naming the first differing option or
            parameter and what each rank has.
    """
    description = describe_params(names, params)
    options = options or {}
    world_size = dist.get_world_size(group)
    local = torch.tensor([fingerprint(description, options)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    watch.wait(all_gather(gathered, local, group))
    if len({int(t.item()) for t in gathered}) == 1:
        return
    per_rank = gather_objects((description, options), group, device)
    rank = dist.get_rank(group)
    option_message = format_option_mismatch([o for _, o in per_rank], rank)
    raise RuntimeError(option_message or format_param_mismatch([d for d, _ in per_rank], rank))
