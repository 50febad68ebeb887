"""sdc_guard: catch silent data corruption inside PyTorch data-parallel training (DDP, FSDP2, HSDP).

Public API (stable): ``fingerprint``, ``fingerprint_tensor``, ``GuardConfig``, ``ChecksumConfig``,
``SDCGuard``, ``StepReport``, ``Detection``, ``EventLog``, ``read_events``,
``state_tensors``, ``native_kernel``, ``native_enabled``, ``CheckpointManager``,
``ShardedCheckpointManager``, ``GuardMetrics``,
``TensorBoardMetrics``, ``PrometheusMetrics``, the exit codes ``EXIT_QUARANTINED``,
``EXIT_RANK_LOST``, ``EXIT_CONVICTED``; the types ``LossFn`` and
``BatchFor``. See README.md and docs/.
"""

from sdc_guard.checkpoint import CheckpointManager, ShardedCheckpointManager
from sdc_guard.config import ChecksumConfig, GuardConfig
from sdc_guard.events import EventLog, read_events
from sdc_guard.exits import EXIT_CONVICTED, EXIT_QUARANTINED, EXIT_RANK_LOST
from sdc_guard.fingerprints import fingerprint, fingerprint_tensor, native_enabled, native_kernel
from sdc_guard.guard import SDCGuard
from sdc_guard.metrics import GuardMetrics, PrometheusMetrics, TensorBoardMetrics
from sdc_guard.report import Detection, StepReport
from sdc_guard.state import state_tensors
from sdc_guard.types import BatchFor, LossFn

__all__ = [
    "EXIT_CONVICTED",
    "EXIT_QUARANTINED",
    "EXIT_RANK_LOST",
    "BatchFor",
    "CheckpointManager",
    "ChecksumConfig",
    "Detection",
    "EventLog",
    "GuardConfig",
    "GuardMetrics",
    "LossFn",
    "PrometheusMetrics",
    "SDCGuard",
    "ShardedCheckpointManager",
    "StepReport",
    "TensorBoardMetrics",
    "fingerprint",
    "fingerprint_tensor",
    "native_enabled",
    "native_kernel",
    "read_events",
    "state_tensors",
]
__version__ = "0.1.0"
