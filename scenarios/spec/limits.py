"""The largest values a scenario or campaign file may ask for, each refused by name beyond it.

They keep every number inside what torch and the harness can hold (a seed is a signed 64-bit
integer to torch's generators) and keep ``python -m scenarios check`` quick: it builds each
scenario's model and plans every trial, so neither may be unbounded.
"""

from __future__ import annotations

from typing import Final

MAX_SEED: Final = 2**63 - 1
"""Seeds (``seed``, ``[matrix]``/``[sample]`` ``seed``, a fault's ``seed``) lie in
``[0, 2**63 - 1]``."""
MAX_STEPS: Final = 100_000
"""Training steps of a scenario; fault steps and replay intervals lie below it."""
MAX_TRIALS: Final = 20_000
"""Trials in one campaign (fault and clean trials of every scenario together); also the
largest ``clean_trials`` and ``trials_per_site``. Planning this many takes seconds."""
MAX_PARAMETERS: Final = 20_000_000
"""Parameters of a scenario's model (``[model]`` kind, width and depth together)."""
MAX_WORLD_SIZE: Final = 1024
"""Ranks of a scenario."""
