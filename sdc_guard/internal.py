"""The internal interface that the benchmarks and the device checks time and verify.

Not a stable API: these are the parts under the public one (the fused scaling pass,
the non-finite flags word, the replay digest, the kernel's instruction sets, the checks
whose wiring the checksum bench switches, the FSDP2 backend whose reduce-scatter the FSDP
bench times apart from the guard's hooks, the tolerant replay audit whose spread the
tolerant bench records), named here, in one place, so that
``bench/`` never reaches into private modules. Users need none of it.
"""

from __future__ import annotations

from sdc_guard.checks import ChecksumCheck, WeightsCheck
from sdc_guard.checks.replay import (
    BucketPlan,
    ReplayAudit,
    grads_digest,
    replay_term_device,
    replay_term_host,
)
from sdc_guard.checks.replay_tolerant import TolerantReplayAudit
from sdc_guard.checks.sides import FUSED_DEVICES as SIDES_FUSED_DEVICES
from sdc_guard.collectives import PendingSum, flag_rows, flag_words
from sdc_guard.determinism import derive_seed, rng_stream
from sdc_guard.fingerprints.digest import digest_value, loss_word
from sdc_guard.fingerprints.native import (
    ISAS,
    NativeKernel,
    active_kernel,
    kernel_in_use,
    pthreads_kernel,
    torch_libgomp,
)
from sdc_guard.fingerprints.public import tensor_value, tensor_values
from sdc_guard.fingerprints.weighted import DEVICE_CHUNK, INT_OF_SIZE
from sdc_guard.fingerprints.weighted import FUSED_DEVICES as FINGERPRINT_FUSED_DEVICES
from sdc_guard.fingerprints.words import LANES_V2, to_signed64, to_unsigned64
from sdc_guard.hostread import StepRead, cpu_as_device, on_host
from sdc_guard.parallel import fsdp as fsdp_backend
from sdc_guard.parallel.base import BucketListener
from sdc_guard.scaling import check_nonfinite, fused_unscale_ok, scale_and_check
from sdc_guard.state import state_tensors

__all__ = [
    "DEVICE_CHUNK",
    "FINGERPRINT_FUSED_DEVICES",
    "INT_OF_SIZE",
    "ISAS",
    "LANES_V2",
    "SIDES_FUSED_DEVICES",
    "BucketListener",
    "BucketPlan",
    "ChecksumCheck",
    "NativeKernel",
    "PendingSum",
    "ReplayAudit",
    "StepRead",
    "TolerantReplayAudit",
    "WeightsCheck",
    "active_kernel",
    "check_nonfinite",
    "cpu_as_device",
    "derive_seed",
    "digest_value",
    "flag_rows",
    "flag_words",
    "fsdp_backend",
    "fused_unscale_ok",
    "grads_digest",
    "kernel_in_use",
    "loss_word",
    "on_host",
    "pthreads_kernel",
    "replay_term_device",
    "replay_term_host",
    "rng_stream",
    "scale_and_check",
    "state_tensors",
    "tensor_value",
    "tensor_values",
    "to_signed64",
    "to_unsigned64",
    "torch_libgomp",
]
