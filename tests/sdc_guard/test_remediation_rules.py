"""The quarantine's rules without a server: the circuit breaker, the bounded evidence, the
topology's mapping from ranks to nodes, the telemetry without a GPU."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdc_guard import Detection
from sdc_guard.remediation.breaker import BreakerLimits, admit
from sdc_guard.remediation.evidence import append_entries, detection_entry, parse_entries
from sdc_guard.telemetry import gpu_snapshot, pci_bus_id
from sdc_guard.topology import RankPlace, Topology, local_place

LIMITS = BreakerLimits(max_nodes=2, max_fraction=0.5, window_s=100.0)


def test_fraction_never_forbids_a_single_node() -> None:
    tiny = BreakerLimits(max_nodes=5, max_fraction=0.01)
    assert tiny.limit(nodes_in_job=3) == 1  # floor(0.03) = 0, but one node is always allowed
    assert admit(["n1"], {}, now=0.0, nodes_in_job=3, limits=tiny).cordon == ("n1",)


def test_absolute_limit_bounds_a_large_job() -> None:
    assert BreakerLimits(max_nodes=5, max_fraction=0.1).limit(nodes_in_job=288) == 5


def test_many_suspects_trip_and_nothing_is_cordoned() -> None:
    adm = admit(["a", "b", "c"], {}, now=0.0, nodes_in_job=4, limits=LIMITS)
    assert adm.tripped and adm.cordon == ()
    assert "max_nodes=2" in adm.reason and "software" in adm.reason


def test_known_nodes_count_once_and_get_evidence_only() -> None:
    held = {"a": 10.0}
    adm = admit(["a"], held, now=20.0, nodes_in_job=4, limits=LIMITS)
    assert (adm.cordon, adm.known, adm.tripped) == ((), ("a",), False)
    adm = admit(["a", "b"], held, now=20.0, nodes_in_job=4, limits=LIMITS)
    assert (adm.cordon, adm.known, adm.tripped) == (("b",), ("a",), False)


def test_window_slides() -> None:
    held = {"a": 0.0, "b": 50.0}
    assert admit(["c"], held, now=60.0, nodes_in_job=4, limits=LIMITS).tripped
    assert admit(["c"], held, now=120.0, nodes_in_job=4, limits=LIMITS).cordon == ("c",)


@pytest.mark.parametrize("bad", [dict(max_nodes=-1), dict(max_fraction=1.5),
                                 dict(window_s=0), dict(max_nodes=True)])
def test_limits_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        BreakerLimits(**bad)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(suspects=st.lists(st.sampled_from("abcdefgh"), max_size=6),
       held=st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0, 200), max_size=6),
       max_nodes=st.integers(0, 6), fraction=st.floats(0, 1), job=st.integers(1, 300))
def test_breaker_never_exceeds_its_limit(suspects: list[str], held: dict[str, float],
                                         max_nodes: int, fraction: float, job: int) -> None:
    limits = BreakerLimits(max_nodes=max_nodes, max_fraction=fraction, window_s=100.0)
    now = 200.0
    adm = admit(suspects, held, now=now, nodes_in_job=job, limits=limits)
    recent = {n for n, t in held.items() if now - t < 100.0}
    limit = min(max_nodes, max(1, math.floor(fraction * job)))
    assert set(adm.cordon).isdisjoint(recent)
    if not adm.tripped:
        assert set(adm.cordon) | set(adm.known) == set(suspects)
    if adm.cordon:
        assert len(recent) + len(adm.cordon) <= limit
    new = set(suspects) - recent
    assert adm.tripped == (bool(new) and len(recent) + len(new) > limit)


def _detection(step: int, payload: int = 100) -> Detection:
    return Detection("weights", step, (1,), "fingerprints differ",
                     {"fingerprints": ["x" * payload]}, suspect_nodes=("n1",))


def test_evidence_keeps_the_newest_and_counts_the_dropped() -> None:
    text = None
    for step in range(200):
        text = append_entries(text, [detection_entry(_detection(step), job="j", now=step)],
                              limit=4096)
        assert text is not None and len(text.encode()) <= 4096
    dropped, entries = parse_entries(text)
    assert entries[-1]["step"] == 199
    assert [e["step"] for e in entries] == list(range(200 - len(entries), 200))
    assert dropped == 200 - len(entries) > 0


def test_an_entry_larger_than_the_limit_is_cut_not_lost() -> None:
    text = append_entries(None, [detection_entry(_detection(3, payload=10_000), job="j")],
                          limit=2048)
    _, entries = parse_entries(text)
    assert entries[0]["step"] == 3 and "cut" in entries[0] and "evidence" not in entries[0]


@settings(max_examples=60, deadline=None)
@given(detail=st.text(max_size=20_000), payload=st.text(max_size=20_000),
       old=st.lists(st.text(max_size=3000), max_size=5),
       limit=st.integers(min_value=512, max_value=8192))
def test_the_whole_annotation_stays_under_its_cap(detail: str, payload: str, old: list[str],
                                                   limit: int) -> None:
    """Whatever the detail and the evidence hold (non-ASCII included), the annotation written
    fits ``limit`` bytes and keeps the newest detection's check, step and suspects."""
    text = None
    for i, blob in enumerate(old):
        text = append_entries(text, [{"kind": "detection", "step": i, "detail": blob}],
                              limit=limit)
    d = Detection("weights", 99, (1,), detail, {"blob": payload}, suspect_nodes=("n1",))
    text = append_entries(text, [detection_entry(d, job="j", now=1.0)], limit=limit)
    assert len(text.encode()) <= limit
    _, entries = parse_entries(text)
    assert entries[-1]["step"] == 99 and entries[-1]["suspect_nodes"] == ["n1"]


def test_a_detail_of_megabytes_is_shortened_saying_so() -> None:
    d = Detection("weights", 4, (1,), "x" * (4 << 20), {}, suspect_nodes=("n1",))
    text = append_entries(None, [detection_entry(d, job="j")])
    assert len(text) <= 64 * 1024
    entry = parse_entries(text)[1][0]
    assert entry["detail"].endswith("characters cut]") and entry["step"] == 4


def test_foreign_annotation_text_survives_as_unparsed() -> None:
    _, entries = parse_entries(append_entries("not json", [{"kind": "x"}]))
    assert entries[0]["kind"] == "unparsed" and entries[1] == {"kind": "x"}


def test_detection_json_carries_nodes() -> None:
    rec = _detection(5).to_json()
    assert rec["suspect_nodes"] == ["n1"]
    json.dumps(rec)


def test_topology_maps_ranks_to_nodes() -> None:
    topo = Topology((RankPlace(0, "h0", "n0"), RankPlace(1, "h1", "n1"), RankPlace(2, "h2", "n1")))
    assert topo.nodes == ("n0", "n1")
    assert topo.nodes_of([2, 1]) == ("n1",)
    assert topo.ranks_on("n1") == (1, 2)


def test_local_place_reads_the_downward_api_and_falls_back_to_the_hostname() -> None:
    p = local_place(3, environ={"NODE_NAME": "gpu-7", "POD_NAME": "job-worker-2",
                                "POD_NAMESPACE": "ml"})
    assert (p.rank, p.node, p.pod, p.namespace) == (3, "gpu-7", "job-worker-2", "ml")
    p = local_place(0, environ={})
    assert p.node == p.hostname and p.pod is None
    p = local_place(0, node_env="MY_NODE", environ={"MY_NODE": "x", "NODE_NAME": "y"})
    assert p.node == "x"


def test_telemetry_without_a_gpu_says_so() -> None:
    snap = gpu_snapshot(torch.device("cpu"))
    assert snap["available"] is False and "no GPU" in snap["reason"]
    json.dumps(snap)


def test_the_pci_bus_id_is_nvmls_string() -> None:
    """torch gives the domain, bus and device numbers apart; NVML looks a device up by one
    string (an integer bus number was refused with "Invalid Argument" on an H200)."""
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    assert pci_bus_id(props) == "00000000:1B:00.0"
    assert pci_bus_id(SimpleNamespace(pci_domain_id=1, pci_bus_id=200, pci_device_id=31)) == \
        "00000001:C8:1F.0"
    assert pci_bus_id(SimpleNamespace(pci_bus_id=0x1B)) is None  # an older torch
