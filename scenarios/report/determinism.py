"""The determinism axis's part of the report: the exact replay audit (deterministic kernels)
beside the tolerant one (kernels that are not deterministic), on the same faults.

The campaign's ``deterministic = [true, false]`` axis gives each trial one of the two, drawn
like its replay interval, so both halves are random samples of the same fault space. A
``false`` trial runs on its scenario's testbed (``Scenario.nondeterministic``: up to 4 ulps of
noise on every linear output, drawn afresh at every recomputation) and is judged against that
testbed's own golden run, bit for bit: the testbed keys its draws so that a rank's training
pass is reproducible while every recomputation rounds differently (``injectors.noise``).

For each mode: false positives (clean trials with a detection; ``not_bit_identical``: clean
trials that did not reproduce their golden run, which would be a harness bug), coverage by
site (detected of the trials that changed the run), the exponent flips the tolerant audit is
built for (bits 27-30 of a float32 activation or local gradient, injected at an audit step,
transient, not masked: detected in that step and the right rank named), and what escapes by
bit.
"""

from __future__ import annotations

from typing import Any, Final

import pandas as pd

from scenarios.report.checksum import coverage, first_bit, rate

MODES: Final = (("exact", True), ("tolerant", False))
"""The report's name of each mode, and its ``deterministic`` value."""
AUDITED_SITES: Final = ("activation", "gradient_before_allreduce")
"""Activations and local gradients: what the replay audit recomputes."""
TOP_EXPONENT: Final = (27, 28, 29, 30)
BIT_GROUPS: Final = (("mantissa 0-7", range(0, 8)), ("mantissa 8-15", range(8, 16)),
                     ("mantissa 16-22", range(16, 23)), ("exponent 23-26", range(23, 27)),
                     ("exponent 27-30", range(27, 31)), ("sign 31", range(31, 32)))
"""float32 bits grouped for the escape table (each group's trials pooled)."""


def _coverage(g: pd.DataFrame) -> dict[str, Any]:
    """``coverage``, and of the detections: the right rank named, named transient."""
    det = g[g["outcome"] == "detected"]
    return {**coverage(g),
            "right_rank": rate(int(det["blame_correct"].fillna(False).sum()), len(det)),
            "transient": int(det["transient"].fillna(False).sum())}


def _on_audit_step(df: pd.DataFrame) -> pd.Series:
    k = df["replay_interval"].astype("Int64")
    step = df["fault_step"].astype("Int64")
    return ((k > 0) & (step % k.where(k > 0, 1) == 0)).fillna(False).astype(bool)


def determinism_summary(df: pd.DataFrame) -> dict[str, Any] | None:
    """The determinism section of ``summary.json`` (None unless some trial ran with
    ``deterministic = false``)."""
    det = df["deterministic"]
    if not (det.fillna(True) == False).any():  # noqa: E712 - a nullable boolean column
        return None
    mode_of = det.fillna(True).astype(bool)
    faults, clean = df[df["kind"] == "fault"], df[df["kind"] == "clean"]
    sites = [s for s in faults["site"].unique() if s]
    out: dict[str, Any] = {"modes": {}}
    bits_all = first_bit(faults)
    for name, value in MODES:
        f = faults[mode_of[faults.index] == value]
        c = clean[mode_of[clean.index] == value]
        bits = bits_all[f.index]
        flips = f[f["site"].isin(AUDITED_SITES) & (f["injected_dtype"] == "float32")
                  & (f["fault_model"] == "transient") & bits.isin(list(TOP_EXPONENT)).fillna(False)
                  & _on_audit_step(f) & (f["outcome"] != "masked")]
        caught = flips[(flips["outcome"] == "detected") & flips["same_step"].fillna(False)
                       & flips["blame_correct"].fillna(False)]
        by_bit: dict[str, Any] = {}
        for site in sites:
            fs = f[f["site"] == site]
            bs = bits[fs.index]
            by_bit[site] = {label: _coverage(fs[bs.isin(list(r)).fillna(False)])
                            for label, r in BIT_GROUPS}
        out["modes"][name] = {
            "false_positives": {"clean_trials": len(c),
                                "detected": int((c["outcome"] == "detected").sum()),
                                "not_bit_identical": int((c["outcome"] != "masked").sum()
                                                         - (c["outcome"] == "detected").sum())},
            "all": _coverage(f),
            "sites": {s: _coverage(f[f["site"] == s]) for s in sites},
            "top_exponent_on_audit_steps": {
                "definition": "transient flips of float32 bits 27-30 at activation or "
                              "gradient_before_allreduce, injected at an audit step, that "
                              "changed the run (not masked): detected in that step, the "
                              "right rank named",
                **rate(len(caught), len(flips))},
            "escapes_by_bits": by_bit,
        }
    return out
