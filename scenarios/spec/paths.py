"""Paths a spec names stay inside the output directory.

A scenario or campaign name becomes a directory name (``runs/<name>``,
``reports/<name>``), and ``[guard] event_log`` a file the ranks write. A spec file
may come from someone else, so none of them may point outside ``--out``: names are
single path components (``need_name``), ``event_log`` is a relative path without
``..`` (``need_relative``, when the file is read), and, when a run starts, the path
it names under ``--out`` must not leave it through a symbolic link either
(``inside``).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath
from typing import Any

from scenarios.spec.errors import ScenarioError

NAME_CHARS = "letters, digits, - _ . (not starting with a dot)"


def need_name(name: str, v: Any) -> None:
    """A name usable as one file name: letters, digits, ``-_.``, not starting with a dot (so
    never ``.`` or ``..``)."""
    if (not isinstance(v, str) or not v or v.startswith(".") or len(v) > 128
            or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in v)):
        raise ScenarioError(name, v, f"a name of 1 to 128 {NAME_CHARS}",
                            reason="it names a directory of the output")


def need_relative(name: str, v: Any) -> None:
    """A relative path with no ``..`` component (``v`` a str or a ``PurePath``)."""
    if not isinstance(v, (str, PurePath)) or not str(v).strip():
        raise ScenarioError(name, v, "a non-empty relative path, e.g. \"events.jsonl\"")
    p = PurePath(v)
    if p.is_absolute() or p.anchor:
        raise ScenarioError(name, str(v), "a relative path (it is written under --out), e.g. "
                            f"{p.name!r}", reason="an absolute path leaves the output directory")
    if ".." in p.parts:
        raise ScenarioError(name, str(v), "a relative path without '..' (it is written under "
                            "--out)", reason="'..' leaves the output directory")


def inside(out: Path, rel: str | PurePath, name: str) -> Path:
    """``out / rel`` as an absolute path with every symbolic link resolved, refused (naming
    ``name``) unless it lies below ``out``: ``rel`` absolute or with ``..``, ``out`` itself,
    or a symbolic link on the way pointing outside."""
    need_relative(name, rel)
    base = Path(os.path.realpath(out))
    target = Path(os.path.realpath(base / rel))
    if base not in target.parents:
        raise ScenarioError(name, str(rel), "a file path that stays inside --out",
                            reason=f"{out / rel} leads to {target}, outside {base}")
    return target
