"""torchreplicate: composable data parallelism for PyTorch.

``replicate(model)`` makes ``model`` a data-parallel replica in place: after
every backward, each parameter's ``.grad`` is the mean over all ranks.
"""

from torchreplicate.api import ReplicateModule, replicate
from torchreplicate.checkpoint import load_ddp_state_dict
from torchreplicate.config import ReplicateConfig
from torchreplicate.core.state import ReplicateState
from torchreplicate.launcher import WorkerError, launch
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
    "StepSummary",
    "WorkerError",
    "launch",
    "load_ddp_state_dict",
    "log_summary",
    "replicate",
    "trace",
    "verify_replicas",
]
