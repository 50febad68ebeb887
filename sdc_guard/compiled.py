"""Expressions of torch operations that ``torch.compile`` fuses where a device runs them
faster that way (the fingerprint's weighted sum, the checksum's sides), each used only once
its compiled form has agreed with the torch operations it stands for.

A ``CheckedCompile`` compiles each expression once (dynamic shapes, one graph: past dynamo's
recompile limit that is a failure, not a silent uncompiled run), compares its first result
for each key with the torch operations' (a compiler bug must not move a fingerprint or a
checksum), and gives the key up for those operations, with a warning, if it fails to compile
or to agree. An input that cannot tell (``agree`` answers None: the checksum's sides of data
holding NaN or Inf) decides nothing: the torch operations serve that call and the next
compares again. The caller runs the torch operations whenever it returns None.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch


class CheckedCompile:
    """Compiled expressions and what their first results showed (module doc)."""

    def __init__(self) -> None:
        self.fns: dict[Any, Callable[..., Any]] = {}
        """The compiled functions, by the key their caller names them with."""
        self.checked: dict[Any, bool] = {}
        """Per check key: whether the first compiled result agreed (absent: not run yet)."""
        self._lock = threading.Lock()

    def run(self, name: Hashable, math: Callable[..., Any], key: Hashable, label: str,
            eager: Callable[[], Any], agree: Callable[[Any, Any], bool | None], *args: Any,
            fallback: str = "") -> Any | None:
        """``math(*args)`` compiled (as ``name``), or None where ``key`` was given up, inside a
        graph being traced, or now: it failed to compile, its first result disagreed with
        ``eager()`` (``agree``), or this input could not tell (``agree`` None: asked again
        on the next). ``label`` names it in the warning; ``fallback`` says what the torch
        operations cost instead."""
        if self.checked.get(key) is False:
            return None
        compiling = getattr(torch.compiler, "is_compiling", None)  # (torch >= 2.3)
        if compiling is not None and compiling():  # inside a graph being traced: torch ops
            return None
        try:
            with self._lock:
                fn = self.fns.get(name)
                if fn is None:
                    fn = self.fns[name] = torch.compile(math, dynamic=True, fullgraph=True)
            got = fn(*args)
            if key not in self.checked:
                agrees = agree(got, eager())
                if agrees is None:  # this input cannot tell: the next one is compared
                    return None
                self.checked[key] = agrees
                if not agrees:
                    warnings.warn(f"sdc_guard: {label} gave another value compiled than "
                                  "torch's operations; those are used.", RuntimeWarning,
                                  stacklevel=4)
                    return None
            return got
        except Exception as e:  # no compiler, no triton, an unsupported torch: torch ops
            self.checked[key] = False
            warnings.warn(f"sdc_guard: {label} did not compile ({type(e).__name__}: "
                          f"{str(e)[:200]}); torch's operations are used{fallback}.",
                          RuntimeWarning, stacklevel=4)
            return None
