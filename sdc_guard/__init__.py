"""sdc_guard: catch silent data corruption inside PyTorch DDP training.

Public API (stable): ``fingerprint``, ``GuardConfig``, ``SDCGuard``, ``StepReport``,
``Detection``. See DESIGN.md and README.md.
"""

from sdc_guard.config import GuardConfig
from sdc_guard.events import EventLog, read_events
from sdc_guard.fingerprints import fingerprint, fingerprint_tensor
from sdc_guard.guard import SDCGuard
from sdc_guard.report import Detection, StepReport

__all__ = [
    "Detection",
    "EventLog",
    "GuardConfig",
    "SDCGuard",
    "StepReport",
    "fingerprint",
    "fingerprint_tensor",
    "read_events",
]
__version__ = "0.1.0"
