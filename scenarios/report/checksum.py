"""The checksum check's part of the report: its false positives, its coverage beside the same
faults with the check off, bit by bit, and the escape rate of checksum + replay per interval.

The campaign's ``checksum = [false, true]`` axis gives each fault trial the check on or off,
drawn like its replay interval, so both halves are random samples of the same faults.

"Above the rounding bound" (the issue's target set) is measured, not assumed: linear-product
faults that flipped an exponent bit of a non-zero normal entry. Such a flip changes the entry
by at least half its own magnitude, a million times the float32 rounding bound of an entry of
typical size (``sdc_guard.checks.checksum``). Flips of zeros and denormals, and of the
mantissa's lower bits, change an entry by less than the bound can resolve: the bit chart shows
where that line falls.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from scenarios.report.stats import wilson
from scenarios.report.table import json_list

FLOAT32_EXPONENT = range(23, 31)
"""The exponent bits of a float32 word; 28-30 are the three most significant."""
TOP_EXPONENT = (28, 29, 30)
FINITE_SITES = ("activation", "activation_grad", "linear_product")
"""The sites whose faults only the replay audit and (at linear layers) the checksum see."""


def rate(k: int, n: int) -> dict[str, Any]:
    """``k`` of ``n``: the count, the rate and its 95% Wilson interval."""
    return {"count": k, "of": n, "rate": k / n if n else None, "ci95": wilson(k, n)}


def coverage(g: pd.DataFrame) -> dict[str, Any]:
    """Trials, masked, and the detected and escaped rates of the trials not masked."""
    relevant = g[g["outcome"] != "masked"]
    return {
        "trials": len(g), "masked": int((g["outcome"] == "masked").sum()),
        "detected": rate(int((relevant["outcome"] == "detected").sum()), len(relevant)),
        "escaped": rate(int((relevant["outcome"] == "escaped").sum()), len(relevant)),
    }


def _outcomes(g: pd.DataFrame) -> dict[str, Any]:
    det = g[g["outcome"] == "detected"]
    return {**coverage(g), "by_checksum": int(
        (det["checks"].str.split("+").map(lambda c: "checksum" in c)).sum())}


def first_bit(df: pd.DataFrame) -> pd.Series:
    """Each row's flipped bit when the first firing flipped exactly one (else None)."""
    return json_list(df["bits"]).map(lambda b: b[0] if len(b) == 1 else None)


def _above_bound(lp: pd.DataFrame) -> pd.DataFrame:
    """Exponent flips of a non-zero normal float32 entry (module doc)."""
    bit = first_bit(lp)
    value = lp["injected_value"].astype("Float64").abs()
    return lp[(lp["field"] == "exponent") & bit.isin(list(FLOAT32_EXPONENT)).fillna(False)
              & (value >= 2.0 ** -126).fillna(False)]


def checksum_summary(df: pd.DataFrame) -> dict[str, Any] | None:
    """The checksum section of ``summary.json`` (None when no trial ran the check)."""
    on = df["checksum"].fillna(False).astype(bool)
    if not on.any():
        return None
    faults, clean = df[df["kind"] == "fault"], df[df["kind"] == "clean"]
    f_on, f_off = faults[on[faults.index]], faults[~on[faults.index]]
    c_on = clean[on[clean.index]]
    sites = [s for s in faults["site"].unique() if s]
    out: dict[str, Any] = {
        "false_positives": {"clean_trials": len(c_on),
                            "detected": int((c_on["outcome"] == "detected").sum()),
                            "by_checksum": int(c_on["checks"].str.contains("checksum").sum())},
        "sites": {s: {"off": _outcomes(f_off[f_off["site"] == s]),
                      "on": _outcomes(f_on[f_on["site"] == s])} for s in sites},
    }
    lp_on = f_on[f_on["site"] == "linear_product"]
    lp_off = f_off[f_off["site"] == "linear_product"]
    f32 = lp_on[lp_on["injected_dtype"] == "float32"]
    bits_on, bits_off = first_bit(lp_on), first_bit(lp_off)
    out["linear_product_bits"] = {
        str(b): {"on": _outcomes(lp_on[bits_on == b]), "off": _outcomes(lp_off[bits_off == b])}
        for b in sorted({int(x) for x in pd.concat([bits_on, bits_off]).dropna()})}
    above = _above_bound(f32)
    det = above[above["outcome"] == "detected"]
    top = above[first_bit(above).isin(list(TOP_EXPONENT)).fillna(False)]
    top_ok = top[(top["outcome"] == "detected") & top["same_step"].fillna(False)
                 & top["contained"].fillna(False) & top["blame_correct"].fillna(False)]
    out["above_bound"] = {
        "definition": "linear_product faults, checksum on: an exponent bit flipped in a "
                      "non-zero normal float32 entry",
        **_outcomes(above),
        "same_step_contained_right_rank": rate(
            int((det["same_step"].fillna(False) & det["contained"].fillna(False)
                 & det["blame_correct"].fillna(False)).sum()), len(above)),
        "top_exponent_bits": {"bits": list(TOP_EXPONENT),
                              "same_step_contained_right_rank": rate(len(top_ok), len(top))},
    }
    by_k: dict[str, Any] = {}
    finite = faults[faults["site"].isin(FINITE_SITES)
                    & faults["field"].isin(("sign", "exponent", "mantissa", "any"))]
    for k in sorted(int(x) for x in faults["replay_interval"].dropna().unique()):
        row: dict[str, Any] = {}
        for name, sel in (("off", ~on), ("on", on)):
            g = finite[(finite["replay_interval"] == k) & sel[finite.index]]
            row[name] = _outcomes(g)
            lp = g[g["site"] == "linear_product"]
            row[f"linear_product_{name}"] = _outcomes(lp)
            row[f"linear_product_above_bound_{name}"] = _outcomes(
                _above_bound(lp[lp["injected_dtype"] == "float32"]))
        by_k[str(k)] = row
    out["replay_intervals"] = by_k
    return out
