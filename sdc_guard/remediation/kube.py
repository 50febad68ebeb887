"""KubeQuarantine: cordon, taint and annotate the node of a suspect rank, off the training path.

``SDCGuard(..., remediation=KubeQuarantine(...))`` hands it every detection, already mapped to
nodes (``Detection.suspect_nodes``). It acts on detections with suspects:

- the acting rank (rank 0 by default, one rank only) asks the circuit breaker
  (``remediation.breaker``) with the count every writer of the job shares (the job's Lease,
  ``remediation.lease``: the nodes are reserved there before they are cordoned), then for each
  admitted node: marks it unschedulable, adds our
  ``NoSchedule`` taint, writes our marker and the evidence (annotations, see
  ``remediation.evidence``) in one read-modify-write, and creates a Kubernetes Event on the
  node. A node this job already quarantined gets the evidence appended, no second taint, and
  at most one write per ``evidence_interval_s`` (entries wait and travel together).
- a suspect rank appends its own GPU telemetry snapshot (taken by the guard on that rank, at
  detection time) to its node's evidence: no collective, nothing that a hung suspect blocks.
- when the breaker trips, nothing is cordoned; an ERROR log record and an Event on the acting
  rank's pod say why.

The API calls run on a worker thread: ``act`` returns at once and never raises, and an API
server that is slow, failing or gone costs the training step nothing (``guard.flush()`` waits
for outstanding calls at most ``deadline_s``). Every outcome is in ``actions`` and in the
guard's event log (``{"event": "quarantine", ...}``).

Dry run is the default: every write is sent with ``dryRun=All``, so the server authenticates,
authorises, validates and answers as it would, and stores nothing. The breaker counts dry-run
quarantines in memory; real ones are in the job's Lease and are also read back from the cluster
(our marker names the job and the time), so a job restarted after a quarantine, or a second
instance of it, counts the nodes it took.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdc_guard.exits import EXIT_CONVICTED, EXIT_QUARANTINED
from sdc_guard.remediation.api import JsonPatch, KubeError, NodeAPI, annotation_ops, load_client
from sdc_guard.remediation.breaker import BreakerLimits
from sdc_guard.remediation.evidence import (
    EVIDENCE,
    MARKER,
    append_entries,
    detection_entry,
    has_our_taint,
    marker,
    our_taint,
    parse_marker,
    telemetry_entry,
)
from sdc_guard.remediation.lease import SharedBreaker
from sdc_guard.report import Detection
from sdc_guard.topology import Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class QuarantineAction:
    """One outcome of the quarantine, for the event log, the campaign and tests."""

    action: str
    """"cordon" (a node quarantined), "evidence" (appended to a node we hold), "breaker"
    (tripped: nothing cordoned), "error" (an API call failed for good)."""
    node: str | None
    dry_run: bool
    check: str
    step: int
    time: float
    detail: str = ""
    nodes: tuple[str, ...] = field(default=())
    """For "breaker": the suspect nodes it refused."""

    def to_json(self) -> dict[str, Any]:
        return {"event": "quarantine", "action": self.action, "node": self.node,
                "dry_run": self.dry_run, "check": self.check, "step": self.step,
                "time": self.time, "detail": self.detail, "nodes": list(self.nodes)}


class KubeQuarantine:
    """Quarantine the nodes of suspect ranks through the Kubernetes API. See the module doc."""

    def __init__(self, *, dry_run: bool = True, max_nodes: int = 1, max_fraction: float = 0.1,
                 kubeconfig: str | Path | None = None, window_s: float = 3600.0,
                 evidence_interval_s: float = 60.0, deadline_s: float = 5.0,
                 request_timeout_s: float = 5.0, retries: int = 4, backoff_s: float = 0.5,
                 job: str | None = None, acting_rank: int = 0,
                 event_namespace: str = "default", namespace: str | None = None) -> None:
        """``dry_run``: send every write with ``dryRun=All`` (the default; ``False`` acts).
        ``max_nodes``/``max_fraction``/``window_s``: the circuit breaker. ``kubeconfig``: None
        in a pod (service account), else a kubeconfig path. ``evidence_interval_s``: at most one
        evidence write per node per interval. ``deadline_s``: the longest ``guard.flush()``
        waits for outstanding API calls. ``request_timeout_s``, ``retries``, ``backoff_s``: per
        call. ``job``: the job's name in our marker (default ``$SDC_GUARD_JOB``, set from the
        PyTorchJob's label in ``deploy/pytorchjob.yaml``); the breaker counts per job.
        ``acting_rank``: the one rank that cordons. ``event_namespace``: where node Events go.
        ``namespace``: the job's namespace, where the breaker's Lease lives (default: the acting
        rank's pod namespace, ``POD_NAMESPACE``, else ``default``).
        """
        if not isinstance(dry_run, bool):
            raise ValueError(f"KubeQuarantine(dry_run=...) must be True or False, got {dry_run!r}.")
        for name, value in (("evidence_interval_s", evidence_interval_s),
                            ("deadline_s", deadline_s), ("request_timeout_s", request_timeout_s),
                            ("backoff_s", backoff_s)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"KubeQuarantine({name}=...) must be a number of seconds >= 0, "
                                 f"got {value!r}.")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"KubeQuarantine(retries=...) must be an int >= 0, got {retries!r}.")
        self.dry_run = dry_run
        self.limits = BreakerLimits(max_nodes=max_nodes, max_fraction=max_fraction,
                                    window_s=window_s)
        self.evidence_interval_s = float(evidence_interval_s)
        self.deadline_s = float(deadline_s)
        self.job = job or os.environ.get("SDC_GUARD_JOB") or f"unnamed@{socket.gethostname()}"
        if len(self.job) > 253:
            raise ValueError(f"KubeQuarantine(job=...) must be at most 253 characters (it is "
                             f"written in every node's marker), got {len(self.job)}; pass the "
                             "job's name (a PyTorchJob's metadata.name)")
        self.acting_rank = acting_rank
        self.event_namespace = event_namespace
        self.namespace = namespace
        self.api = NodeAPI(load_client(kubeconfig), request_timeout_s=request_timeout_s,
                           retries=retries, backoff_s=backoff_s)
        self.actions: list[QuarantineAction] = []
        """Every outcome so far, in order (appended by the worker thread)."""
        self.topology: Topology | None = None
        self.rank: int | None = None
        self._log_event: Callable[[dict[str, Any]], None] | None = None
        self._jobs: queue.Queue[tuple[str, Detection] | None] = queue.Queue()
        self._busy = 0
        self._idle = threading.Condition()
        self._mine: dict[str, float] = {}
        self._last_write: dict[str, float] = {}
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._worker: threading.Thread | None = None
        self.breaker: SharedBreaker | None = None
        """The job's count shared through its Lease (``remediation.lease``); set by ``bind``."""

    # -- the guard's side ------------------------------------------------------------------
    def bind(self, *, topology: Topology, rank: int,
             log_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Called by ``SDCGuard`` once, with every rank's place; starts the worker thread."""
        if not 0 <= self.acting_rank < len(topology.places):
            raise ValueError(f"KubeQuarantine(acting_rank={self.acting_rank}) is not a rank of "
                             f"this job (world size {len(topology.places)}).")
        self.topology, self.rank, self._log_event = topology, rank, log_event
        me = topology.places[self.acting_rank]
        self.breaker = SharedBreaker(
            self.api, namespace=self.namespace or me.namespace or "default", job=self.job,
            limits=self.limits, identity=me.pod or f"{me.hostname}/{os.getpid()}",
            dry_run=self.dry_run)
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="sdc-guard-quarantine",
                                            daemon=True)
            self._worker.start()
            atexit.register(_close_at_exit, weakref.ref(self))

    def act(self, detection: Detection) -> None:
        """Queue the work this rank owes for ``detection``; returns at once, never raises."""
        if self.topology is None or self.rank is None or not detection.suspect_nodes:
            return
        if self.rank == self.acting_rank:
            self._submit(("quarantine", detection))
        elif self.rank in detection.suspect_ranks:
            self._submit(("telemetry", detection))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the queued work, at most ``timeout`` (default ``deadline_s``) seconds;
        True when none is left. Evidence held back by the rate limit stays held."""
        deadline = time.monotonic() + (self.deadline_s if timeout is None else timeout)
        with self._idle:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def holds(self, nodes: Iterable[str]) -> bool:
        """True when this process has quarantined every one of ``nodes`` (dry-run
        quarantines count only in a dry run)."""
        return all(n in self._mine for n in nodes)

    def restart_code(self, detections: Iterable[Detection]) -> int | None:
        """The exit code for this rank after ``detections`` (call after ``guard.flush()``, which
        waits for the quarantine), or None to keep training.

        None without an unrepaired detection with suspects, and always in a dry run (a restart
        would land on the same node). Otherwise ``EXIT_QUARANTINED`` (200: retried by
        ``restartPolicy: ExitCode``), except on the acting rank when the suspects' nodes are
        not quarantined (the breaker tripped, the API refused): ``EXIT_CONVICTED`` (3), a
        permanent failure that a person should look at. Every rank gets the same detections,
        so all of them leave; only the acting rank knows whether the quarantine held (no
        collective on the detection path), so a job that wants one code on every rank shares
        the acting rank's (``examples/train_guarded.py`` broadcasts it)."""
        convicted = [d for d in detections if d.suspect_ranks and not d.repaired]
        if not convicted or self.dry_run:
            return None
        if self.rank != self.acting_rank:
            return EXIT_QUARANTINED
        return EXIT_QUARANTINED if self.holds(n for d in convicted for n in d.suspect_nodes) \
            else EXIT_CONVICTED

    def close(self, timeout: float | None = None) -> None:
        """Write the evidence held back by the rate limit and stop the worker (bounded)."""
        if self._worker is None:
            return
        self._jobs.put(None)
        self._worker.join(self.deadline_s if timeout is None else timeout)
        self._worker = None

    # -- the worker ------------------------------------------------------------------------
    def _submit(self, job: tuple[str, Detection]) -> None:
        with self._idle:
            self._busy += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            due = [t + self.evidence_interval_s for n, t in self._last_write.items()
                   if self._pending.get(n)]
            wait = max(0.0, min(due) - time.time()) if due else None
            try:
                job = self._jobs.get(timeout=wait)
            except queue.Empty:
                job = ()  # type: ignore[assignment]
            if job is None:
                self._flush_pending(force=True)
                return
            try:
                if job:
                    kind, d = job
                    (self._quarantine if kind == "quarantine" else self._telemetry)(d)
                self._flush_pending(force=False)
            except Exception as e:  # the training must never crash because of the API
                log.exception("sdc-guard quarantine failed")
                self._record("error", None, job[1] if job else None, f"{type(e).__name__}: {e}")
            finally:
                if job:
                    with self._idle:
                        self._busy -= 1
                        self._idle.notify_all()

    def _quarantine(self, d: Detection) -> None:
        assert self.topology is not None and self.breaker is not None
        now = time.time()
        held = dict(self._mine)
        try:
            if not self.dry_run:
                held.update(self._held_in_cluster(now))
            # the count every writer of this job shares: the nodes are reserved in the job's
            # Lease before any is cordoned, so N instances together stay within the limits
            adm = self.breaker.reserve(d.suspect_nodes, held_elsewhere=held, now=now,
                                       nodes_in_job=len(self.topology.nodes))
        except KubeError as e:  # fail closed: without the count the breaker cannot judge
            log.error("sdc-guard: not cordoning: %s", e)
            self._record("error", None, d, f"not cordoning: cannot count the nodes this job "
                         f"already quarantined: {e}")
            return
        entry = detection_entry(d, job=self.job, now=now)
        if adm.tripped:
            log.error("sdc-guard: %s (detection by %s at step %d, job %s)", adm.reason, d.check,
                      d.step, self.job)
            self._record("breaker", None, d, adm.reason, nodes=tuple(n for n in d.suspect_nodes
                                                                    if n not in adm.known))
            self._alert(d, adm.reason)
        for node in adm.cordon:
            if not self._guarded(d, node, functools.partial(self._cordon, node, d, entry)):
                self.breaker.give_back(node, now)
        for node in adm.known:
            self._guarded(d, node, functools.partial(self._evidence, node, d, [entry]))

    def _telemetry(self, d: Detection) -> None:
        assert self.topology is not None and self.rank is not None
        node = self.topology.places[self.rank].node
        snap = d.evidence.get("telemetry", {"available": False, "reason": "not taken"})
        entry = telemetry_entry(d, rank=self.rank, job=self.job, snapshot=snap)
        self._guarded(d, node, lambda: self._evidence(node, d, [entry]))

    def _guarded(self, d: Detection, node: str, fn: Callable[[], None]) -> bool:
        """``fn()``; False (and an "error" record) when it failed."""
        try:
            fn()
        except KubeError as e:
            log.error("sdc-guard quarantine of node %s: %s", node, e)
            self._record("error", node, d, str(e))
            return False
        return True

    def _cordon(self, node: str, d: Detection, entry: dict[str, Any]) -> None:
        def change(obj: dict[str, Any], *, evidence: bool = True) -> JsonPatch:
            spec = obj.get("spec") or {}
            taints = list(spec.get("taints") or [])
            notes = (obj.get("metadata") or {}).get("annotations") or {}
            annotations: dict[str, str | None] = (
                {EVIDENCE: append_entries(notes.get(EVIDENCE), [entry])} if evidence else {})
            if has_our_taint(taints) and MARKER in notes:  # ours already (an earlier run)
                return annotation_ops(obj, annotations)
            if not has_our_taint(taints):
                taints.append(our_taint())
            annotations[MARKER] = marker(d, job=self.job, now=entry["time"],
                                         already_unschedulable=bool(spec.get("unschedulable")))
            return [*annotation_ops(obj, annotations),
                    {"op": "add", "path": "/spec/unschedulable", "value": True},
                    {"op": "add", "path": "/spec/taints", "value": taints}]

        lost = ""
        try:
            obj = self.api.update(node, change, dry_run=self.dry_run)
        except KubeError as e:
            if e.status not in (413, 422):
                raise
            # the evidence did not fit beside the node's other annotations: the cordon and the
            # taint must not depend on it, so they go alone
            obj = self.api.update(node, functools.partial(change, evidence=False),
                                  dry_run=self.dry_run)
            lost = f"; the evidence was refused ({e}), it is in the job's event log"
        now = time.time()
        self._mine[node] = now
        self._last_write[node] = now
        self._node_event(obj, d)
        self._record("cordon", node, d, ("dry run (dryRun=All): nothing stored" if self.dry_run
                                         else "cordoned, tainted, evidence written")
                     if not lost else "cordoned, tainted" + lost)

    def _evidence(self, node: str, d: Detection, entries: list[dict[str, Any]]) -> None:
        last = self._last_write.get(node)
        if last is not None and time.time() - last < self.evidence_interval_s:
            self._pending.setdefault(node, []).extend(entries)
            return
        self._write_evidence(node, entries)
        self._record("evidence", node, d, f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")

    def _write_evidence(self, node: str, entries: list[dict[str, Any]]) -> None:
        def change(obj: dict[str, Any]) -> JsonPatch:
            notes = (obj.get("metadata") or {}).get("annotations") or {}
            return annotation_ops(obj, {EVIDENCE: append_entries(notes.get(EVIDENCE), entries)})

        self.api.update(node, change, dry_run=self.dry_run)
        self._last_write[node] = time.time()

    def _flush_pending(self, *, force: bool) -> None:
        for node in list(self._pending):
            last = self._last_write.get(node, 0.0)
            if force or time.time() - last >= self.evidence_interval_s:
                entries = self._pending.pop(node)
                try:
                    self._write_evidence(node, entries)
                    self._record("evidence", node, None, f"{len(entries)} held-back entries")
                except KubeError as e:
                    log.error("sdc-guard evidence for node %s: %s", node, e)
                    self._record("error", node, None, str(e))

    def _held_in_cluster(self, now: float) -> dict[str, float]:
        """Nodes whose marker says this job quarantined them within the window."""
        out: dict[str, float] = {}
        for obj in self.api.list():
            meta = obj.get("metadata") or {}
            mark = parse_marker((meta.get("annotations") or {}).get(MARKER))
            if (mark and mark.get("job") == self.job
                    and has_our_taint((obj.get("spec") or {}).get("taints"))
                    and now - float(mark.get("time", 0)) < self.limits.window_s):
                out[str(meta.get("name"))] = float(mark["time"])
        return out

    def _node_event(self, node: dict[str, Any], d: Detection) -> None:
        meta = node.get("metadata") or {}
        self._event(self.event_namespace, {"kind": "Node", "apiVersion": "v1",
                                           "name": meta.get("name"), "uid": meta.get("uid")},
                    "SDCQuarantine", f"sdc-guard quarantined this node: {d.check} detection at "
                    f"step {d.step}, suspect ranks {list(d.suspect_ranks)} (job {self.job}). "
                    f"{d.detail}")

    def _alert(self, d: Detection, reason: str) -> None:
        assert self.topology is not None and self.rank is not None
        me = self.topology.places[self.rank]
        if me.pod is None:
            return
        try:
            self._event(me.namespace or "default", {"kind": "Pod", "apiVersion": "v1",
                                                    "name": me.pod,
                                                    "namespace": me.namespace or "default"},
                        "SDCQuarantineBreaker", reason)
        except KubeError as e:
            log.error("sdc-guard: the breaker's alert Event could not be written: %s", e)

    def _event(self, namespace: str, involved: dict[str, Any], reason: str, message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.api.event(namespace, {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": "sdc-guard-", "namespace": namespace},
            "involvedObject": involved, "reason": reason, "message": message[:1024],
            "type": "Warning", "source": {"component": "sdc-guard"},
            "reportingComponent": "sdc-guard", "reportingInstance": socket.gethostname(),
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }, dry_run=self.dry_run)

    def _record(self, action: str, node: str | None, d: Detection | None, detail: str, *,
                nodes: tuple[str, ...] = ()) -> None:
        rec = QuarantineAction(action=action, node=node, dry_run=self.dry_run,
                               check=d.check if d else "", step=d.step if d else -1,
                               time=time.time(), detail=detail, nodes=nodes)
        self.actions.append(rec)
        if self._log_event is not None:
            try:
                self._log_event(rec.to_json())
            except OSError as e:
                log.error("sdc-guard: could not write the quarantine record: %s", e)


def _close_at_exit(ref: weakref.ref[KubeQuarantine]) -> None:
    """Held-back evidence is written when the process ends (bounded by ``deadline_s``)."""
    q = ref()
    if q is not None:
        q.close()
