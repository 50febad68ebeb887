"""The cluster a campaign's numbers are priced on: the cost model's ``[cluster]`` table.

A campaign measures coverage, escapes, latency and overhead on a small job; the report's
cost model (``scenarios.report.cost``, ``docs/cost-model.md``) turns them into GPU-hours
lost per day on *your* cluster. Every field has a default with its source; override them
in the campaign file or on the command line (``python -m scenarios report DIR --gpus
4096 --sdc-per-gpu-hour 1e-6 ...``, which wins over the file)::

    [cluster]
    gpus = 16384
    sdc_per_gpu_hour = 2.8e-7
    step_time_s = 6.0
    checkpoint_interval_steps = 300
    restart_s = 600
    escape_gpu_hours = 393216            # default: gpus x 24 h
    overhead_file = "bench/results.json" # your overheads, as report's --overhead-file

    [cluster.overhead]                   # your own measurements (fractions of a step)
    weights = 0.05
    [cluster.field_mix]                  # the fault mix the coverage is weighted by
    nan = 0.005
    [cluster.site_mix]
    weight_storage = 2.0
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from scenarios.spec.errors import ScenarioError, need_int, need_number
from scenarios.spec.tables import known_keys

LLAMA3_GPUS = 16384
LLAMA3_SDC = 6
LLAMA3_DAYS = 54
BITS_FP32 = {"sign": 1, "exponent": 8, "mantissa": 23}

DEFAULT_FIELD_MIX: tuple[tuple[str, float], ...] = (
    ("nan", 0.005), ("inf", 0.005),
    *((f, 0.99 * n / 32) for f, n in BITS_FP32.items()),
)
"""The fault mix over bit fields: NaN and Inf together about 1% of SDC outcomes ("Anatomy
of SDC", arXiv 2605.04213, a gate-level study of a datacenter GPU); the other 99% a
single flipped bit anywhere in a float32 word (sign 1, exponent 8, mantissa 23 of 32 bits).
The same study puts single-bit flips under 40% of bit-flip events: the rest are multi-bit,
which the campaign does not sample (the report says so beside the weighted coverage)."""
DEFAULT_PATTERN_MIX: tuple[tuple[str, float], ...] = (("single", 0.4), ("multi_bit", 0.6))
"""The fault mix over shapes (``injectors.patterns``): the same study ("Anatomy of SDC",
arXiv 2605.04213) puts single-bit flips under 40% of bit-flip events and the rest multi-bit:
single 0.4, multi_bit (several bits of one word) 0.6. It gives no share for bursts across
lanes, columns, whole values or stuck bits: they weigh 0 unless ``[cluster.pattern_mix]``
gives them one. A campaign of one-bit faults alone is priced as before (the shares are
ratios)."""
OVERHEAD_KEYS = ("guard_checks_off", "nonfinite", "weights", "checksum", "replay_fixed",
                 "replay_per_audit")
"""Per-check overheads (fractions of plain DDP's step) a user may set for their hardware;
unset ones come from the campaign's ``overhead.json``."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ClusterSpec:
    """The cluster and the rates the cost model prices a campaign's numbers on."""

    gpus: int = LLAMA3_GPUS
    """GPUs in the job (all stall when one restarts). Default: Llama 3 405B's pre-training,
    16,384 H100s (Llama Team, "The Llama 3 Herd of Models", 2024, section 3.3.4)."""
    sdc_per_gpu_hour: float = LLAMA3_SDC / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)
    """Silent data corruptions that change the training state, per GPU-hour. Default:
    Llama 3 attributed 6 of its 419 unexpected interruptions in a 54-day snapshot on
    16,384 H100s to silent data corruption:
    6 / (54 x 24 x 16,384) = 2.8e-7 (a floor: only the SDCs someone noticed). Meta reports
    about 1 in 1,000 devices affected (Dixit et al., "Silent Data Corruptions at Scale",
    2021); the report's sensitivity line shows the choice at 10x lower and higher rates."""
    step_time_s: float = 6.0
    """One training step on the target hardware, without the guard (seconds). Default:
    Llama 3 405B, derived: 6 x 405e9 parameters x 16M tokens per step / (16,384 GPUs x
    400 TFLOP/s per GPU, the paper's Table 4) = 5.9 s."""
    checkpoint_interval_steps: int = 300
    """Steps between checkpoints (a detected fault rolls back to the last one). Default:
    an assumption, 30 minutes at 6 s a step; set yours."""
    restart_s: float = 600.0
    """Wall seconds from a detection to training again (cordon, replace, reload). Default:
    an assumption, 10 minutes; set yours."""
    escape_gpu_hours: float | None = None
    """GPU-hours one escaped corruption costs (found late, training returns to an older
    checkpoint, or a worse model). Default (None): an assumption, a day of the whole job,
    ``gpus x 24``."""
    overhead: tuple[tuple[str, float], ...] = ()
    """Per-check overheads measured on your hardware (``OVERHEAD_KEYS``), replacing the
    campaign's."""
    overhead_file: str | None = None
    """A JSON file of your hardware's per-check overheads, read as the report's
    ``--overhead-file`` (``bench/results.json`` from ``python -m bench`` on that hardware,
    or a mapping of ``OVERHEAD_KEYS`` to fractions); relative to the campaign file
    (``resolved``). ``[cluster.overhead]`` entries are overridden by it, and
    ``--overhead-file`` on the command line replaces it. None: no file."""
    field_mix: tuple[tuple[str, float], ...] = DEFAULT_FIELD_MIX
    """Relative weight of each bit field among field SDCs (``DEFAULT_FIELD_MIX``); fields
    without a weight count 0."""
    site_mix: tuple[tuple[str, float], ...] = ()
    """Relative weight of each fault site; empty: every site the campaign sampled alike
    (no published per-site rates)."""
    pattern_mix: tuple[tuple[str, float], ...] = DEFAULT_PATTERN_MIX
    """Relative weight of each fault shape (``DEFAULT_PATTERN_MIX``); patterns without a
    weight count 0. ``field_mix`` shapes the one-bit faults within ``single``."""

    def __post_init__(self) -> None:
        need_int("cluster.gpus", self.gpus, 1)
        need_number("cluster.sdc_per_gpu_hour", self.sdc_per_gpu_hour, 0.0, 1.0)
        need_number("cluster.step_time_s", self.step_time_s, 0.0, 1e6, lo_open=True)
        need_int("cluster.checkpoint_interval_steps", self.checkpoint_interval_steps, 1)
        need_number("cluster.restart_s", self.restart_s, 0.0, 1e9)
        if self.escape_gpu_hours is not None:
            need_number("cluster.escape_gpu_hours", self.escape_gpu_hours, 0.0, 1e15)
        for key, v in self.overhead:
            if key not in OVERHEAD_KEYS:
                raise ScenarioError(f"cluster.overhead.{key}", v, f"one of {OVERHEAD_KEYS}",
                                    reason="unknown key")
            need_number(f"cluster.overhead.{key}", v, -1.0, 100.0)
        for table in ("field_mix", "site_mix", "pattern_mix"):
            for key, v in getattr(self, table):
                need_number(f"cluster.{table}.{key}", v, 0.0, 1e9)
        if self.overhead_file is not None and (not isinstance(self.overhead_file, str)
                                               or not self.overhead_file.strip()):
            raise ScenarioError("cluster.overhead_file", self.overhead_file,
                                "a path to a JSON file of your overheads, relative to the "
                                'campaign file (e.g. overhead_file = "bench/results.json")')

    def resolved(self, base_dir: str | Path) -> ClusterSpec:
        """A copy whose ``overhead_file`` is absolute: a relative one is taken relative to
        ``base_dir`` (the campaign file's folder), so the report finds it from anywhere. A
        file that is not there is a ``ScenarioError`` naming the field and the path looked
        at, when the campaign is loaded rather than after its trials have run."""
        if self.overhead_file is None:
            return self
        path = (Path(base_dir) / Path(self.overhead_file).expanduser()).resolve()
        if not path.is_file():
            raise ScenarioError("cluster.overhead_file", self.overhead_file,
                                "a JSON file of your overheads, relative to the campaign "
                                "file", reason=f"no such file: {path}")
        return replace(self, overhead_file=str(path))

    @property
    def escape_cost(self) -> float:
        """GPU-hours per escape (``escape_gpu_hours``, default ``gpus x 24``)."""
        return self.gpus * 24.0 if self.escape_gpu_hours is None else self.escape_gpu_hours

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for table in ("overhead", "field_mix", "site_mix", "pattern_mix"):
            out[table] = dict(out[table])
        if out["overhead_file"] is None:  # written only when given
            del out["overhead_file"]
        return out

    def with_overrides(self, **changes: Any) -> ClusterSpec:
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


SCALARS = ("gpus", "sdc_per_gpu_hour", "step_time_s", "checkpoint_interval_steps",
           "restart_s", "escape_gpu_hours")


def cluster_from_table(table: Mapping[str, Any], prefix: str = "cluster.") -> ClusterSpec:
    """A ``ClusterSpec`` from a ``[cluster]`` table (or ``campaign.json``'s ``cluster``)."""
    known_keys(table, (*SCALARS, "overhead", "field_mix", "site_mix", "pattern_mix",
                       "overhead_file"), prefix)
    kw: dict[str, Any] = {k: table[k] for k in (*SCALARS, "overhead_file")
                          if table.get(k) is not None}
    for sub in ("overhead", "field_mix", "site_mix", "pattern_mix"):
        v = table.get(sub)
        if v is None:
            continue
        if not isinstance(v, Mapping):
            raise ScenarioError(f"{prefix}{sub}", v, f"a table [{prefix}{sub}]")
        kw[sub] = tuple((str(k), x) for k, x in v.items())
    try:
        return ClusterSpec(**kw)
    except TypeError as e:  # a wrong type where dataclass construction itself fails
        raise ScenarioError(prefix.rstrip("."), dict(table), "the fields of [cluster]",
                            reason=str(e)) from None


OPTIONS = {
    "gpus": ("--gpus", int, "GPUs in the job"),
    "sdc_per_gpu_hour": ("--sdc-per-gpu-hour", float, "state-changing SDCs per GPU-hour"),
    "step_time_s": ("--step-time-s", float, "a training step on the target hardware (s)"),
    "checkpoint_interval_steps": ("--checkpoint-interval-steps", int,
                                  "steps between checkpoints"),
    "restart_s": ("--restart-s", float, "detection to training again (s)"),
    "escape_gpu_hours": ("--escape-gpu-hours", float, "GPU-hours one escape costs"),
}
"""``[cluster]`` fields as command-line options of ``report`` (they win over the file)."""


def add_cluster_arguments(parser: Any) -> None:
    """Add the ``[cluster]`` overrides to an ``argparse`` parser (``report``)."""
    group = parser.add_argument_group("cost model ([cluster] overrides, docs/cost-model.md)")
    for name, (flag, kind, text) in OPTIONS.items():
        group.add_argument(flag, dest=f"cluster_{name}", type=kind, metavar="X",
                           help=f"{text} (default: the campaign's [cluster] or "
                                f"{getattr(ClusterSpec(), name) or 'gpus x 24'})")
    group.add_argument("--check-overhead", dest="cluster_overhead", action="append",
                       metavar="CHECK=FRACTION", default=[],
                       help=f"a check's overhead on your hardware, one of {OVERHEAD_KEYS} "
                            "(repeatable)")


def cluster_overrides(args: Any) -> dict[str, Any]:
    """The overrides given on the command line (``add_cluster_arguments``), for
    ``ClusterSpec.with_overrides`` / ``write_report(out, cluster=...)``."""
    out: dict[str, Any] = {n: getattr(args, f"cluster_{n}", None) for n in OPTIONS}
    pairs = []
    for item in getattr(args, "cluster_overhead", None) or []:
        key, sep, value = item.partition("=")
        try:
            pairs.append((key, float(value)))
        except ValueError:
            raise ScenarioError("--check-overhead", item, "CHECK=FRACTION, e.g. weights=0.05",
                                ) from None
        if not sep:
            raise ScenarioError("--check-overhead", item, "CHECK=FRACTION, e.g. weights=0.05")
    if pairs:
        out["overhead"] = tuple(pairs)
    return {k: v for k, v in out.items() if v is not None}
