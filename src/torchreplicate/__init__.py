"""torchreplicate: composable data parallelism for PyTorch.

``replicate(model)`` makes ``model`` a data-parallel replica in place: after
every backward, each parameter's ``.grad`` is the mean over all ranks.
"""

from typing import Any

from torchreplicate.api import ReplicateModule, replicate
from torchreplicate.compat.checkpoint import load_ddp_state_dict
from torchreplicate.config import ReplicateConfig
from torchreplicate.core.state import ReplicateState
from torchreplicate.faults.watchdog import StallWarning
from torchreplicate.observe.summary import StepSummary, log_summary
from torchreplicate.observe.tracing import trace
from torchreplicate.observe.verify import ReplicaMismatchError, ReplicaReport, verify_replicas
from torchreplicate.reducer.comm_hooks import GradBucket
from torchreplicate.version import __version__ as __version__

__all__ = [
    "GradBucket",
    "ReplicaMismatchError",
    "ReplicaReport",
    "ReplicateConfig",
    "ReplicateModule",
    "ReplicateState",
    "StallWarning",
    "StepSummary",
    "load_ddp_state_dict",
    "log_summary",
    "replicate",
    "trace",
    "verify_replicas",
]

# Removed public names, and what replaces them: ``from torchreplicate import launch`` says so.
_REMOVED = {
    "launch": (
        "torchreplicate.launch was removed in 0.2.0: torch has it. Run scripts with torchrun "
        "(torchrun --standalone --nproc-per-node 2 train.py), or a function on N local processes with "
        "torch.distributed.launcher.api.elastic_launch(LaunchConfig(min_nodes=1, max_nodes=1, "
        "nproc_per_node=2, rdzv_backend='c10d', rdzv_endpoint='localhost:0'), fn)(*args), which returns "
        "fn's results by rank (docs/getting-started.md#launching)"
    ),
    "WorkerError": (
        "torchreplicate.WorkerError was removed in 0.2.0 with torchreplicate.launch: torch's elastic_launch "
        "raises torch.distributed.elastic.multiprocessing.errors.ChildFailedError, with the failing rank's traceback"
    ),
}


def __getattr__(name: str) -> Any:
    """Raises ``ImportError`` naming the replacement for a removed name (``launch``, ``WorkerError``).

    An ``ImportError``, not an ``AttributeError``: ``from torchreplicate
    import launch`` would replace the latter with its own message, losing
    the replacement's name.

    Args:
        name: the attribute asked for.
    """
    if name in _REMOVED:
        raise ImportError(_REMOVED[name])
    raise AttributeError(f"module 'torchreplicate' has no attribute {name!r}")
