"""The library on a CUDA device: its device paths against the CPU, guarded DDP on nccl, the
checksum check's torch path, the NVML snapshot.

Every test here is a plain function that imports no pytest and takes no fixtures, only
arguments with defaults: ``device`` (``"cuda"``; ``"cpu"`` runs the same test on the CPU, with
gloo where ranks talk) and ``record``, a dict the test fills with what it found. pytest runs
them under the ``cuda`` marker and skips them where ``torch.cuda.is_available()`` is False
(``conftest.py``); ``python -m bench.device_check`` imports and runs them on a machine that may
lack pytest, and writes each ``record`` into its JSON beside its timings (its ``device_tests``).
"""
