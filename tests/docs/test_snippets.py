"""The documentation's Python snippets run as written (README.md, docs/usage.md,
docs/recovery.md, docs/fsdp.md).

Every fenced ``python`` block of those pages carries a marker on the line before it:

- ``<!-- run: NAME ... -->``: the block runs. ``NAME`` says what it starts from and how it is
  run (``SCENARIOS``): ``loop`` (a whole training loop from nothing but the names
  ``tests/docs/harness.py`` defines: ``MyModel``, ``dataset``, ``total``,
  ``checkpoint_every``), ``built`` (a loop's setup already done: ``model``, ``optimizer``,
  ``scheduler``, ``loss_fn``, ``batch_for``, ``cfg``, ...), ``rollback`` and ``restart``
  (the same, under planted faults; ``restart`` with a Kubernetes stand-in and
  ``quarantine``). The rest of the marker is for the reader.
- ``<!-- not run: REASON -->``: an illustration (signatures, a fragment); the test lists it
  as skipped with its reason (``pytest -rs``).

A block without a marker fails ``test_every_python_snippet_is_marked``. A runnable block is
written into a script between the harness's two lines (``tests/docs/harness.py`` says what
they define) and run as ``torchrun`` would run it: one process per rank on gloo over
127.0.0.1, in a working directory of its own (its ``checkpoints`` and event log), with the
faults the scenario plants on rank 1: a weight bit flipped (the weights check sees it; with 3
ranks twice, so that it is repaired, then convicted), a batch that makes rank 1's forward
non-finite (withheld in its step: contained), or a flip that comes back after every rollback.
Each run is judged by its exit codes, its log and each rank's final state.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kube_standin import StandInAPIServer
from sdc_guard import EXIT_CONVICTED, EXIT_QUARANTINED
from tests.launch import free_port, scaled

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/usage.md", "docs/recovery.md", "docs/fsdp.md")
MARKER = re.compile(r"^<!--\s*(run|not run):\s*(.*?)\s*-->$")
FENCE = re.compile(r"^```python\s*$")


@dataclass(frozen=True)
class Snippet:
    doc: str
    line: int
    """The line of the opening fence (1-based)."""
    marker: tuple[str, str] | None
    """("run", rest) or ("not run", reason); None without a marker."""
    code: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def scenario(self) -> str:
        assert self.marker is not None and self.marker[0] == "run"
        return self.marker[1].split()[0] if self.marker[1] else ""


def snippets(doc: str) -> list[Snippet]:
    """The fenced python blocks of ``doc``, each with the marker on the line before it."""
    lines = (ROOT / doc).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()),
                          "")
            m = MARKER.match(before)
            found.append(Snippet(doc, i + 1, (m.group(1), m.group(2)) if m else None,
                                 "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return found


ALL = [s for doc in DOCS for s in snippets(doc)]


# -- running a snippet ----------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    code: int
    out: str
    """stdout and stderr together."""

    @property
    def fingerprint(self) -> str | None:
        m = re.search(r"SNIPPET-END rank \d+ fingerprint (\w+)", self.out)
        return None if m is None else m.group(1)


def launch(snippet: Snippet, where: Path, world: int, *, faults: dict[str, Any] | None = None,
           kubeconfig: Path | None = None) -> list[Run]:
    """``snippet`` as a script on ``world`` ranks in ``where``; each rank's exit and output."""
    where.mkdir(parents=True)
    setup = "globals().update(build())\n" if snippet.scenario != "loop" else ""
    script = where / "snippet.py"
    script.write_text(f"from tests.docs.harness import *  # noqa: F403\n{setup}"
                      f"# -- {snippet.id} --\n{snippet.code}# --\nfinish(globals())\n")
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "NODE_NAME": f"gpu-{rank}", "POD_NAME": f"job-{rank}",
               "POD_NAMESPACE": "default", "SDC_GUARD_JOB": "snippets",
               "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT),
               "SNIPPET_FAULTS": json.dumps(faults or {}),
               "SNIPPET_KUBECONFIG": "" if kubeconfig is None else str(kubeconfig)}
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=where, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        outs = [p.communicate(timeout=scaled(240))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            if p.stdout is not None and not p.stdout.closed:
                p.communicate()  # reaped and its pipe closed: nothing left for the next test
    return [Run(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


def _ok(runs: list[Run]) -> str:
    assert [r.code for r in runs] == [0] * len(runs), "\n\n".join(r.out for r in runs)
    prints = {r.fingerprint for r in runs}
    assert len(prints) == 1 and None not in prints, prints  # every replica agrees
    (fingerprint,) = prints
    assert fingerprint is not None
    return fingerprint


def _resumed(out: str) -> int:
    m = re.search(r"restored \S+ \(step \d+\); training resumes at step (\d+)", out)
    assert m is not None, out
    return int(m.group(1))


# -- what each kind of snippet must do ---------------------------------------------------------
def scenario_loop(snippet: Snippet, tmp: Path) -> None:
    """A whole loop: on 2 ranks a contained fault (no rollback) and a flipped weight (rolled
    back) end where the fault-free run ends; on 3 ranks a stuck weight is repaired once,
    convicted the second time and rolled back; a flip that comes back after the rollback ends
    every rank with EXIT_CONVICTED."""
    golden = _ok(launch(snippet, tmp / "golden", 2))
    faulted = launch(snippet, tmp / "faulted", 2, faults={"nan": [11], "flip": [17]})
    assert _ok(faulted) == golden  # the rollback went back before both faults: exact
    log = faulted[0].out
    assert re.search(r"SDC detection at step 11 by nonfinite: suspects \[1\] .*; contained", log)
    assert "not contained" in log and _resumed(log) <= 11
    three = launch(snippet, tmp / "three", 3, faults={"flip": [13, 15]})
    _ok(three)
    log = three[0].out
    assert "repaired in place" in log and "a permanent fault" in log
    assert _resumed(log) <= 13
    persists = launch(snippet, tmp / "persists", 2, faults={"flip": [17], "persist": True})
    assert [r.code for r in persists] == [EXIT_CONVICTED] * 2, persists
    assert all(r.fingerprint is None for r in persists)  # it stopped, it did not train on
    assert len(re.findall(r"SDC detection at step", persists[0].out)) <= 4, persists[0].out


def scenario_built(snippet: Snippet, tmp: Path) -> None:
    """A loop's setup done: the snippet trains to the end and leaves checkpoints."""
    _ok(launch(snippet, tmp / "run", 2))
    assert list((tmp / "run").rglob("step-*.pt")), "no checkpoint was saved"


def scenario_rollback(snippet: Snippet, tmp: Path) -> None:
    """The in-process rollback: as ``loop`` on 2 ranks (contained, rolled back, exact)."""
    golden = _ok(launch(snippet, tmp / "golden", 2))
    faulted = launch(snippet, tmp / "faulted", 2, faults={"nan": [11], "flip": [17]})
    assert _ok(faulted) == golden
    assert re.search(r"SDC detection at step 11 by nonfinite: suspects \[1\] .*; contained",
                     faulted[0].out)
    assert _resumed(faulted[0].out) <= 11


def scenario_restart(snippet: Snippet, tmp: Path) -> None:
    """A real quarantine: rank 1's node is cordoned and every rank exits EXIT_QUARANTINED."""
    with StandInAPIServer() as srv:
        for rank in range(3):
            srv.add_node(f"gpu-{rank}")
        kubeconfig = srv.write_kubeconfig(tmp / "kubeconfig")
        # (13, then 15: the vote of 13 is read and repaired in 14, which it withholds)
        runs = launch(snippet, tmp / "run", 3, faults={"flip": [13, 15]}, kubeconfig=kubeconfig)
        assert [r.code for r in runs] == [EXIT_QUARANTINED] * 3, "\n\n".join(r.out for r in runs)
        assert [n for n in ("gpu-0", "gpu-1", "gpu-2")
                if srv.node(n)["spec"].get("unschedulable")] == ["gpu-1"]


SCENARIOS: dict[str, Callable[[Snippet, Path], None]] = {
    "loop": scenario_loop, "built": scenario_built, "rollback": scenario_rollback,
    "restart": scenario_restart,
}


def test_every_python_snippet_is_marked() -> None:
    unmarked = [s.id for s in ALL if s.marker is None]
    assert not unmarked, (f"python blocks without a marker: {unmarked}; put "
                          "'<!-- run: NAME -->' (NAME one of " + ", ".join(SCENARIOS) + ") or "
                          "'<!-- not run: why -->' on the line before each")
    bad = [(s.id, s.marker) for s in ALL if s.marker is not None and (
        (s.marker[0] == "run" and s.scenario not in SCENARIOS)
        or (s.marker[0] == "not run" and not s.marker[1]))]
    assert not bad, f"markers naming no scenario, or skipping without a reason: {bad}"
    assert any(s.doc == "README.md" and s.marker == ("run", s.marker[1]) for s in ALL
               if s.marker is not None), "the README's loop must run"


def test_the_marker_parser_reads_what_the_pages_write(tmp_path: Path) -> None:
    assert MARKER.match("<!-- not run: signatures, not code -->") is not None
    assert MARKER.match("<!-- run: loop (on 2 and 3 ranks) -->") is not None
    assert MARKER.match("<!-- a comment -->") is None


@pytest.mark.timeout(1200)  # several launches of 2-3 ranks; scaled by conftest
@pytest.mark.parametrize("snippet", ALL, ids=[s.id for s in ALL])
def test_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.marker is None:
        pytest.fail(f"{snippet.id}: no marker (test_every_python_snippet_is_marked)")
    kind, rest = snippet.marker
    if kind == "not run":
        pytest.skip(f"{snippet.id}: not run: {rest}")
    SCENARIOS[snippet.scenario](snippet, tmp_path)


def test_the_readme_installs_cpu_torch_before_sdc_guard_and_names_the_cuda_index() -> None:
    # A plain install on a machine without a GPU pulls PyPI's CUDA torch (several GB): the
    # README's CPU-only lines take torch from PyTorch's CPU index first, in one block, and say
    # where a given CUDA build comes from.
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    cpu = [b.splitlines() for b in blocks if "download.pytorch.org/whl/cpu" in b]
    assert cpu, "no install block takes torch from https://download.pytorch.org/whl/cpu"
    lines = cpu[0]
    torch_at = next(i for i, ln in enumerate(lines)
                    if re.search(r"pip install torch\b.*--index-url https://download\.pytorch"
                                 r"\.org/whl/cpu", ln))
    ours_at = next(i for i, ln in enumerate(lines) if re.search(r"pip install sdc-guard", ln))
    assert torch_at < ours_at, lines
    assert re.search(r"download\.pytorch\.org/whl/cu\d+", text), "the CUDA index is not named"
