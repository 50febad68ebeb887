"""Build the API reference of sdc_guard's public modules from their docstrings, with pdoc.

    python docs/build_api.py [-o DIR] [--strict] [MODULE ...]    (or: python3 -m nox -s docs)

Writes HTML into ``docs/_build/api/`` (not committed; open ``index.html``), for ``sdc_guard``
and ``sdc_guard.remediation`` unless modules are named.

pdoc turns a name in a docstring into a link when it finds what the name stands for, and
leaves it as plain text, silently, when it does not: it has no strict mode. So this script
watches pdoc's linking and looks again at each name pdoc could not link that is meant as
one of ours: a dotted name that starts with a documented package (``sdc_guard.guard.Foo``,
also without backticks), a relative one (``.foo``), or a dotted one in backticks that starts
with a name the reference documents (``SDCGuard.step``, ``GuardConfig.replay_interval``).
A name of another library (``torch.sum``) or of a local variable (``guard.step``) is left
alone.

- A name that stands for nothing (a typo, a renamed or removed function or field) is a
  **broken reference**: the build fails (exit 1) and names each one, with the object whose
  docstring holds it.
- A name of something that exists but that the reference does not document (an internal
  module such as ``sdc_guard.checkpoint``, a private member) is printed as a note: its
  reader cannot follow it; point to the page under ``docs/`` that explains it instead.
  ``--strict`` fails on these too.

A warning from pdoc itself (a module it cannot import, an annotation it cannot parse) fails
the build as well.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pdoc
import pdoc.doc
import pdoc.render
from jinja2 import pass_context
from jinja2.runtime import Context
from markupsafe import Markup

PUBLIC_MODULES = ("sdc_guard", "sdc_guard.remediation")
"""The modules users import: their own members and what their ``__all__`` re-exports."""
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "_build" / "api"

_ANCHOR = re.compile(r"<a\s[^>]*>.*?</a>", re.S)
_HIGHLIGHTED_DOT = re.compile(r'</span><span class="o">\.</span><span class="n">')
_CODE_NAME = re.compile(r"<code>(\.*(?!\d)\w+(?:\.(?!\d)\w+)*)(?:\(\))?</code>")


@dataclass(frozen=True)
class Unlinked:
    """A name in a docstring that pdoc could not link."""

    module: str
    """The module being rendered."""
    where: str
    """The documented object whose docstring holds the name ("" for the module's own)."""
    name: str

    def __str__(self) -> str:
        return f"{self.module}: {self.where or '(module docstring)'}: {self.name!r}"


def _documented_names(context: Context) -> set[str]:
    """The public names of every rendered module: a dotted name in backticks that starts with
    one of them is meant as a reference to our own API."""
    is_public = context["is_public"]
    return {m.name for mod in context["all_modules"].values() for m in mod.members.values()
            if is_public(m).strip()}


def _unlinked_text(html: str) -> str:
    """``html`` without the links pdoc made, with its highlighted dotted names joined."""
    return _ANCHOR.sub("", _HIGHLIGHTED_DOT.sub(".", html))


def _names(context: Context, html: str) -> list[str]:
    """The names meant as ours in one docstring's HTML that pdoc left unlinked."""
    roots = sorted({name.split(".")[0] for name in context["all_modules"]})
    rest = _unlinked_text(html)
    found = []
    for root in roots:
        # as pdoc finds a dotted name: not inside a URL or a path (after / = ? # & .)
        found += [m.group(0) for m in
                  re.finditer(rf"(?<![/=?#&.\w-]){re.escape(root)}(?:\.(?!\d)\w+)+", rest)]
    documented = _documented_names(context)
    for m in _CODE_NAME.finditer(rest):
        name = m.group(1)
        first = name.lstrip(".").split(".")[0]
        if name.startswith(".") or ("." in name and (first in documented or first in roots)):
            found.append(name)
    return found


def watch_links(unlinked: list[Unlinked]) -> None:
    """Wrap pdoc's ``linkify`` filter: the names it leaves unlinked in docstrings (its calls
    with ``shorten=False``) are appended to ``unlinked``."""
    original = pdoc.render.env.filters["linkify"]

    @pass_context
    def linkify(context: Context, code: str, namespace: str = "", shorten: bool = True) -> Markup:
        html: Markup = original(context, code, namespace=namespace, shorten=shorten)
        if not shorten:
            module = context["module"].modulename
            for name in _names(context, str(html)):
                entry = Unlinked(module, namespace, name)
                if entry not in unlinked:
                    unlinked.append(entry)
        return html

    pdoc.render.env.filters["linkify"] = linkify


def _lookup(obj: object, path: list[str]) -> bool:
    """Does ``obj.a.b...`` exist (a class's annotated fields count, set or not)?"""
    for part in path:
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, type) and any(part in getattr(k, "__annotations__", {})
                                           for k in obj.__mro__):
            return part == path[-1]
        else:
            return False
    return True


def exists(name: str, module: str) -> bool:
    """Does ``name``, as written in a docstring of ``module``, stand for anything: a module,
    or an object reached from one (absolute, relative to ``module``, or in its namespace)?"""
    if name.startswith("."):  # as pdoc reads it: in a package, its child; else a sibling
        base = module.split(".")
        if not hasattr(importlib.import_module(module), "__path__"):
            base = base[:-1]
        dots = len(name) - len(name.lstrip("."))
        name = ".".join([*base[: len(base) - dots + 1], name.lstrip(".")])
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            mod = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        return _lookup(mod, parts[cut:])
    return _lookup(importlib.import_module(module), parts)


def build(modules: Iterable[str], output: Path) -> tuple[list[str], list[str]]:
    """Render ``modules`` into ``output``: (problems that fail the build, notes)."""
    unlinked: list[Unlinked] = []
    watch_links(unlinked)
    pdoc.render.configure(docformat="restructuredtext", search=True, show_source=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*modules, output_directory=output)
    pdoc_dir = str(Path(pdoc.__file__).parent)
    problems = [f"pdoc: {w.message}" for w in caught if str(w.filename).startswith(pdoc_dir)]
    notes = []
    for u in unlinked:
        if exists(u.name, u.module):
            notes.append(f"{u}: not in the reference (an internal module or a private member)")
        else:
            problems.append(f"{u}: broken reference (it names nothing)")
    return problems, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("modules", nargs="*", default=list(PUBLIC_MODULES),
                    help=f"modules to document (default: {' '.join(PUBLIC_MODULES)})")
    ap.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT,
                    help="directory for the HTML (default: docs/_build/api)")
    ap.add_argument("--strict", action="store_true",
                    help="fail on names the reference does not document, too")
    args = ap.parse_args(argv)
    problems, notes = build(args.modules, args.output)
    if args.strict:
        problems, notes = problems + notes, []
    for n in notes:
        print(f"build_api: note: {n}", file=sys.stderr)
    for p in problems:
        print(f"build_api: error: {p}", file=sys.stderr)
    if problems:
        print(f"build_api: {len(problems)} error(s); the reference in {args.output} has them",
              file=sys.stderr)
        return 1
    print(f"build_api: the API reference of {', '.join(args.modules)}: "
          f"{args.output / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
