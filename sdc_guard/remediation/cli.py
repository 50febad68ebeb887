"""``python -m sdc_guard quarantine list|show NODE|release NODE``: the operator's review.

``list`` shows the nodes that carry our taint or our marker, with the job, the first
detection and how much evidence they hold; ``show NODE`` prints a node's marker, taints and
evidence as JSON; ``release NODE`` returns it to service after review: it removes our taint
(only ours: our key with our effect; another tool's taint of the same key and another effect
stays), uncordons it when we cordoned it, and moves the marker and the evidence into the
``sdc-guard.io/history`` annotation, with an Event on the node. A node someone else had
cordoned before us stays cordoned, and ``release`` refuses it unless ``--force``; a node we
never quarantined is refused. An administrator who cordons a node we already cordoned
changes nothing Kubernetes records, so ``release`` cannot see it: it prints the node's other
taints, and ``--keep-cordon`` removes ours but leaves the node unschedulable.

Time: each API call makes at most ``--retries`` + 1 requests of ``--request-timeout`` seconds,
with a backoff of 0.5 s, doubling, between them (the client's own retries are off).

Auth: ``--kubeconfig PATH`` (default ``$KUBECONFIG``, else ``~/.kube/config``), or
``--in-cluster`` with the pod's service account. ``--dry-run`` sends the release with
``dryRun=All``: the server validates it and stores nothing.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from sdc_guard.remediation.api import JsonPatch, KubeError, NodeAPI, annotation_ops, load_client
from sdc_guard.remediation.evidence import (
    EVIDENCE,
    HISTORY,
    MARKER,
    TAINT_EFFECT,
    TAINT_KEY,
    append_entries,
    has_our_taint,
    parse_entries,
    parse_marker,
)


def add_parser(sub: Any) -> None:
    q = sub.add_parser("quarantine", help="list, show or release nodes quarantined by sdc-guard",
                       description=(__doc__ or "").replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    auth = argparse.ArgumentParser(add_help=False)
    auth.add_argument("--kubeconfig", default=None,
                      help="kubeconfig path (default: $KUBECONFIG, else ~/.kube/config)")
    auth.add_argument("--in-cluster", action="store_true",
                      help="use the pod's service account instead of a kubeconfig")
    auth.add_argument("--request-timeout", type=float, default=10.0, metavar="S",
                      help="seconds per API request (default 10)")
    auth.add_argument("--retries", type=int, default=2, metavar="N",
                      help="retries of a failed or timed-out request (default 2)")
    verbs = q.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", parents=[auth], help="nodes quarantined by sdc-guard")
    show = verbs.add_parser("show", parents=[auth], help="a node's marker, taints and evidence")
    show.add_argument("node")
    rel = verbs.add_parser("release", parents=[auth], help="return a node to service")
    rel.add_argument("node")
    rel.add_argument("--force", action="store_true",
                     help="release a node someone else had cordoned first (it stays cordoned; "
                          "only our taint and marker go)")
    rel.add_argument("--dry-run", action="store_true",
                     help="send the release with dryRun=All: validated, nothing stored")
    rel.add_argument("--keep-cordon", action="store_true",
                     help="remove our taint and marker but leave the node unschedulable (e.g. "
                          "an administrator cordoned it too)")
    rel.add_argument("--reason", default="", help="why, for the node's history")


def run(args: argparse.Namespace) -> int:
    if args.request_timeout <= 0:
        print(f"error: --request-timeout must be > 0 seconds, got {args.request_timeout}",
              file=sys.stderr)
        return 1
    if args.retries < 0:
        print(f"error: --retries must be >= 0, got {args.retries}", file=sys.stderr)
        return 1
    try:
        api = NodeAPI(load_client(None if args.in_cluster else _kubeconfig(args.kubeconfig)),
                      request_timeout_s=args.request_timeout, retries=args.retries, backoff_s=0.5)
        if args.verb == "list":
            return _list(api)
        if args.verb == "show":
            return _show(api, args.node)
        return _release(api, args.node, force=args.force, dry_run=args.dry_run,
                        reason=args.reason, keep_cordon=args.keep_cordon)
    except KubeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _kubeconfig(given: str | None) -> str:
    if given:
        return given
    env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return env or str(Path("~/.kube/config").expanduser())


def _ours(node: dict[str, Any]) -> bool:
    notes = (node.get("metadata") or {}).get("annotations") or {}
    return MARKER in notes or has_our_taint((node.get("spec") or {}).get("taints"))


def _list(api: NodeAPI) -> int:
    rows = []
    for node in api.list():
        if not _ours(node):
            continue
        meta = node.get("metadata") or {}
        notes = meta.get("annotations") or {}
        mark = parse_marker(notes.get(MARKER)) or {}
        dropped, entries = parse_entries(notes.get(EVIDENCE))
        since = mark.get("time")
        rows.append([
            str(meta.get("name")),
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(since))) + "Z" if since else "?",
            str(mark.get("job", "?")),
            f"{mark.get('check', '?')}@{mark.get('step', '?')}",
            str(len(entries) + dropped),
            "yes" if (node.get("spec") or {}).get("unschedulable") else "no",
            "yes" if mark.get("already_unschedulable") else "no",
        ])
    if not rows:
        print("no node is quarantined by sdc-guard")
        return 0
    head = ["NODE", "SINCE", "JOB", "FIRST DETECTION", "EVIDENCE", "CORDONED", "CORDONED BEFORE US"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _show(api: NodeAPI, name: str) -> int:
    node = api.get(name)
    notes = (node.get("metadata") or {}).get("annotations") or {}
    dropped, entries = parse_entries(notes.get(EVIDENCE))
    hist_dropped, history = parse_entries(notes.get(HISTORY))
    print(json.dumps({
        "node": name,
        "quarantined_by_sdc_guard": _ours(node),
        "unschedulable": bool((node.get("spec") or {}).get("unschedulable")),
        "taints": (node.get("spec") or {}).get("taints") or [],
        "marker": parse_marker(notes.get(MARKER)),
        "evidence": entries, "evidence_dropped": dropped,
        "history": history, "history_dropped": hist_dropped,
    }, indent=2, sort_keys=True))
    return 0


def _is_ours(taint: dict[str, Any]) -> bool:
    return taint.get("key") == TAINT_KEY and taint.get("effect") == TAINT_EFFECT


def _release(api: NodeAPI, name: str, *, force: bool, dry_run: bool, reason: str,
             keep_cordon: bool = False) -> int:
    refused: list[str] = []

    def change(node: dict[str, Any]) -> JsonPatch | None:
        refused.clear()
        spec = node.get("spec") or {}
        notes = (node.get("metadata") or {}).get("annotations") or {}
        mark = parse_marker(notes.get(MARKER))
        if not _ours(node):
            refused.append(f"node {name!r} is not quarantined by sdc-guard (no taint "
                           f"{TAINT_KEY!r}, no marker); nothing to release")
            return None
        before_us = mark is None or bool(mark.get("already_unschedulable"))
        if before_us and not force:
            refused.append(
                f"node {name!r} was cordoned before sdc-guard quarantined it (or our marker is "
                "gone), so someone else may still need it out of service; --force removes our "
                "taint and marker and leaves it cordoned")
            return None
        _, entries = parse_entries(notes.get(EVIDENCE))
        record = {"kind": "release", "time": time.time(), "by": _who(), "reason": reason,
                  "forced": force, "kept_cordon": keep_cordon, "marker": mark,
                  "evidence": entries}
        ops = annotation_ops(node, {MARKER: None, EVIDENCE: None,
                                    HISTORY: append_entries(notes.get(HISTORY), [record])})
        ops.append({"op": "add", "path": "/spec/taints",
                    "value": [t for t in spec.get("taints") or [] if not _is_ours(t)]})
        if not before_us and not keep_cordon:
            ops.append({"op": "add", "path": "/spec/unschedulable", "value": False})
        return ops

    node = api.update(name, change, dry_run=dry_run)
    if refused:
        print(f"refused: {refused[0]}", file=sys.stderr)
        return 2
    meta = node.get("metadata") or {}
    api.event("default", {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": "sdc-guard-", "namespace": "default"},
        "involvedObject": {"kind": "Node", "apiVersion": "v1", "name": name, "uid": meta.get("uid")},
        "reason": "SDCRelease", "type": "Normal", "source": {"component": "sdc-guard"},
        "message": f"released by {_who()} after review" + (f": {reason}" if reason else ""),
    }, dry_run=dry_run)
    spec = node.get("spec") or {}
    still = bool(spec.get("unschedulable"))
    why = "--keep-cordon" if keep_cordon else "someone else cordoned it first"
    print(f"{'dry run: would release' if dry_run else 'released'} node {name}: our taint and "
          f"marker removed, evidence moved to {HISTORY}"
          + (f"; it stays cordoned ({why})" if still else "; uncordoned"))
    others = [t for t in spec.get("taints") or [] if not _is_ours(t)]
    if others:
        print("other taints on the node (not ours, left as they are): " + ", ".join(
            f"{t.get('key')}{'=' + str(t['value']) if t.get('value') else ''}:{t.get('effect')}"
            for t in others))
    elif not still:
        print("no other taints on the node; an administrator's cordon made after ours leaves no "
              "trace: if one was meant, cordon it again or release with --keep-cordon")
    return 0


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
