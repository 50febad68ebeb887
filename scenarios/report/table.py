"""``trials.csv`` as a typed pandas DataFrame: one row per trial, one dtype per column.

Integers are nullable ``Int64``, measurements ``Float64``, flags nullable ``boolean``
(``true``/``false``; an empty cell is missing), the JSON cells (``suspects``,
``cordoned_nodes``, ...) stay text until a table needs them (``json_list``), and the
grouping keys (``site``, ``field``, ...) are strings with an empty cell read as ``""``.
The file is opened through ``TrialTable`` first, which cuts a torn last line (a kill in
the middle of a write); a line with too many cells is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from scenarios.run.store import COLUMNS, TrialTable

INTS = ("fault_rank", "fault_step", "replay_interval", "detect_step", "injections",
        "first_injection", "first_divergence", "latency_from_injection",
        "latency_from_divergence", "steps_run", "quarantine_errors", "rollback_step",
        "wasted_steps", "saves_refused")
FLOATS = ("rel_weight_dev", "loss_diff", "seconds", "fault_to_cordon_s", "fault_to_resume_s",
          "injected_value")
BOOLS = ("blame_correct", "contained", "same_step", "nonfinite_injected", "repaired",
         "cordon_correct", "breaker_tripped", "final_matches_golden", "checksum",
         "deterministic", "transient")
KEYS = ("id", "scenario", "kind", "site", "field", "fault_model", "outcome", "check", "checks",
        "product", "injected_dtype", "parallel", "pattern")
"""Text columns a table groups or filters by; an empty cell reads as ``""``."""


def read_trials(path: str | Path) -> pd.DataFrame:
    """Every complete row of ``trials.csv`` (an empty frame with the columns when absent)."""
    path = Path(path)
    TrialTable(path)  # repairs a torn last line
    dtypes: dict[str, Any] = {c: "string" for c in COLUMNS}
    dtypes.update({c: "Int64" for c in INTS})
    dtypes.update({c: "Float64" for c in FLOATS})
    dtypes.update({c: "boolean" for c in BOOLS})
    if not path.exists() or not path.read_text().strip():
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in dtypes.items()}).fillna(
            {c: "" for c in KEYS})
    df = pd.read_csv(path, dtype=dtypes, true_values=["true"], false_values=["false"],
                     keep_default_na=False, na_values=[""], on_bad_lines="skip")
    for c in COLUMNS:  # a table written before a column existed
        if c not in df:
            df[c] = pd.Series(pd.NA, index=df.index, dtype=dtypes[c])
    return df.fillna({c: "" for c in KEYS})


def json_list(col: pd.Series) -> pd.Series:
    """A JSON column (``suspects``, ``cordoned_nodes``) as lists; a missing cell is ``[]``."""
    return col.map(lambda v: [] if pd.isna(v) else json.loads(v))


def py(v: Any) -> Any:
    """A pandas / NumPy scalar as the plain Python value ``json`` writes (NA -> None)."""
    if v is None or v is pd.NA or (isinstance(v, float) and v != v):
        return None
    try:
        if pd.isna(v):
            return None
    except (TypeError, ValueError):
        pass
    return v.item() if hasattr(v, "item") else v
