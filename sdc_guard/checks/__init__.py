"""The guard's checks. Each one is a small collaborator that ``SDCGuard.step`` sequences."""

from sdc_guard.checks.nonfinite import NonFiniteCheck
from sdc_guard.checks.weights import WeightsCheck, state_tensors

__all__ = ["NonFiniteCheck", "WeightsCheck", "state_tensors"]
