"""What ``pip install sdc-guard`` puts into a user's environment: the library, nothing else.

The wheel holds one top-level package, ``sdc_guard``, with the C kernel's sources it builds
on first use; the harness (``injectors``, ``scenarios``, ``bench``) and the Kubernetes API
stand-in (``kube_standin``) run from a clone (docs/harness.md). ``import sdc_guard`` imports
none of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.launch import scaled

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ("injectors", "scenarios", "bench", "kube_standin")
"""Top-level packages of the clone that are not the library."""
CLONE_ONLY = (*HARNESS, "tests")

_NOT_SOURCE = shutil.ignore_patterns(".git", ".nox", ".venv", "build", "dist", "*.egg-info",
                                     "__pycache__", ".*_cache", ".hypothesis", "reports", "runs")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", **extra}


def test_the_wheel_holds_sdc_guard_alone_with_the_kernel_sources(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")  # the build backend, used without build isolation
    src = tmp_path / "src"  # a copy: the build leaves build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    assert all((src / name).is_dir() for name in ("injectors", "scenarios", "bench", "tests"))
    out = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=scaled(300), env=_env(), cwd=tmp_path)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    [wheel] = out.glob("sdc_guard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"sdc_guard"}, sorted(top)
    kernel = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "sdc_guard").rglob("*")
                    if p.suffix in (".c", ".h"))
    assert kernel, "no C kernel sources found under sdc_guard/"
    assert set(kernel) <= set(names), sorted(set(kernel) - set(names))
    assert "sdc_guard/py.typed" in names
    assert not [n for n in names if n.endswith(".toml")]  # scenario configs stay in the clone


def _imported(cwd: Path, env: dict[str, str]) -> tuple[set[str], str]:
    """Every module ``import sdc_guard`` imports (``-X importtime``), and what the process
    could import of the harness."""
    probe = ("import importlib.util, sdc_guard; print(' '.join(n for n in "
             f"{HARNESS!r} if importlib.util.find_spec(n) is not None))")
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", probe], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=scaled(120))
    assert r.returncode == 0, r.stderr[-3000:]
    modules = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines()
               if line.startswith("import time:") and "|" in line}
    modules.discard("imported package")  # the header line
    return modules, r.stdout.strip()


def test_import_sdc_guard_imports_no_harness(tmp_path: Path) -> None:
    # As a user's job imports it: outside the clone, which is then not on sys.path.
    modules, reachable = _imported(tmp_path, _env())
    assert "sdc_guard" in modules
    stray = sorted(m for m in modules if m.split(".")[0] in CLONE_ONLY)
    assert stray == [], stray
    assert reachable == "", (
        f"outside the clone {reachable!r} can be imported: the installed sdc-guard maps more "
        "than sdc_guard (an editable install from before the wheel shipped the library "
        "alone? reinstall: pip install -e .)")
    # With the clone on sys.path the harness can be imported: it still is not.
    modules, reachable = _imported(tmp_path, _env(PYTHONPATH=str(ROOT)))
    assert reachable.split() == [n for n in HARNESS if (ROOT / n).is_dir()]
    stray = sorted(m for m in modules if m.split(".")[0] in CLONE_ONLY)
    assert stray == [], stray
