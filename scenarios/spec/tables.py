"""Reading TOML files and checking their tables before they become spec records."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from scenarios.spec.errors import ScenarioError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed file; a missing, unreadable or malformed file is a ``ScenarioError``."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ScenarioError("file", str(p), "an existing TOML file", file=p) from None
    except OSError as e:
        raise ScenarioError("file", str(p), "a readable TOML file", reason=e.strerror or str(e),
                            file=p) from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError("toml", str(e), "valid TOML", file=p) from None


def known_keys(table: Mapping[str, Any], names: Iterable[str], prefix: str) -> None:
    """Refuse a key of ``table`` that is not in ``names`` (``prefix``: the table's dotted path)."""
    allowed = list(names)
    for key in table:
        if key not in allowed:
            raise ScenarioError(f"{prefix}{key}", table[key], f"the keys {sorted(allowed)}",
                                reason="unknown key")


def table_of(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``data[key]`` if it is a table, ``{}`` if absent."""
    v = data.get(key, {})
    if not isinstance(v, Mapping):
        raise ScenarioError(key, v, "a TOML table ([" + key + "])")
    return v


def tuples(table: Mapping[str, Any]) -> dict[str, Any]:
    """The table with its arrays as tuples (the records are frozen)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` applied table by table (a campaign's ``[quick]`` overrides)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(
            out.get(k), Mapping) else v
    return out
