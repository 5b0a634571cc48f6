"""torchreplicate: composable data parallelism for PyTorch.

``replicate(model)`` makes ``model`` a data-parallel replica in place: after
every backward, each parameter's ``.grad`` is the mean over all ranks.
"""

from typing import Any

from torchreplicate.api import ReplicateModule, replicate
from torchreplicate.comm_hooks import GradBucket
from torchreplicate.config import ReplicateConfig
from torchreplicate.state import ReplicateState
from torchreplicate.summary import StepSummary, log_summary
from torchreplicate.tracing import trace
from torchreplicate.verify import ReplicaMismatchError, ReplicaReport, verify_replicas

__all__ = [
    "GradBucket",
    "ReplicaMismatchError",
    "ReplicaReport",
    "ReplicateConfig",
    "ReplicateModule",
    "ReplicateState",
    "StepSummary",
    "launch",
    "log_summary",
    "replicate",
    "trace",
    "verify_replicas",
]
__version__ = "0.2.0.dev0"


def __getattr__(name: str) -> Any:
    # The launcher loads on first use, so `python -m torchreplicate.launch`
    # does not find its own module imported already.
    if name == "launch":
        from torchreplicate.launcher import launch

        return launch
    raise AttributeError(f"module 'torchreplicate' has no attribute {name!r}")
