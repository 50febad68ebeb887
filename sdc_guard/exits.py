"""The exit codes a guarded job ends with, and what a restart policy does with each.

Kubeflow's ``restartPolicy: ExitCode`` retries a pod that exits with 128-255 (recreating it,
so the scheduler avoids a cordoned node) and treats 1-127 as a permanent failure that a
person must look at; torchrun's elastic agent restarts the job on any non-zero code up to
``--max-restarts``. None of the three is a signal's code (128 + N for signal N <= 64).
"""

from __future__ import annotations

EXIT_QUARANTINED = 200
"""Leave after a real quarantine of a suspect node, so that the job restarts elsewhere from
its newest clean checkpoint (retried: 128-255). See ``examples/train_guarded.py``."""

EXIT_RANK_LOST = 201
"""Leave because another rank fell out of the job (the watchdog, ``GuardConfig.
collective_timeout_s``): the job restarts from its checkpoint (retried: 128-255)."""

EXIT_CONVICTED = 3
"""Leave because a rank was convicted and could not be quarantined (no cluster, a dry run,
the breaker tripped, the API refused): restarting would put the job back on the same
hardware, so this is a permanent failure (1-127) that a person must look at: cordon the
named node by hand (``kubectl cordon``), or release the breaker, then resubmit."""
