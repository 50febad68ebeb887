"""One writer per output directory: a lock on ``OUT/.lock`` held while a command writes there.

Two campaigns writing one ``--out`` at once would append the same trials twice to
``trials.csv``, and one would delete the checkpoints the other's trial is using. So
every command that writes an output directory (``campaign``, ``run``, ``merge``,
``report``) first takes an exclusive ``flock`` on ``OUT/.lock``, without waiting: a
second one is refused at once with ``OutputBusy``, naming the holder's pid, host and
command (written into the file by the holder). The lock belongs to the open file, so
it ends with its process, SIGKILL included: a lock file left by a killed run blocks
nothing, and it is never deleted (deleting it would let a third run lock a new file
while the second still holds the old one).

Nested holds in one process (the CLI around the campaign and its report, the runner
inside it) share the one lock. ``flock`` works on local filesystems and on NFS
(Linux emulates it with a byte-range lock there).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from scenarios.spec.errors import ScenarioError

LOCK_NAME = ".lock"

_held: dict[str, list[int]] = {}
"""Output directories this process holds: real path -> [file descriptor, depth]."""


class OutputBusy(ScenarioError):
    """Another process holds the output directory's lock."""

    def __init__(self, out: Path, holder: str) -> None:
        super().__init__("out", str(out), "an output directory no other run is writing",
                         reason=f"held by {holder}; wait for it to finish or pass another "
                                "--out")
        self.out = out
        self.holder = holder


def holder_of(out: Path) -> str:
    """Who holds ``out``'s lock, as its lock file says (pid, host, command, since)."""
    try:
        info = json.loads((out / LOCK_NAME).read_text())
        return (f"pid {info['pid']} on host {info['host']} ({info['command']}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info['since']))})")
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid and host yet"


@contextlib.contextmanager
def hold_output(out: str | Path, *, command: str = "", create: bool = True) -> Iterator[None]:
    """Hold ``out``'s lock for the block (``create``: make the directory if absent);
    ``OutputBusy`` at once if another process holds it."""
    path = Path(out)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(path)
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        for _ in range(20):  # the holder writes its pid right after it locks
            holder = holder_of(path)
            if not holder.startswith("a process"):
                break
            time.sleep(0.01)
        raise OutputBusy(path, holder) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                "command": command or " ".join(["python", *sys.argv])}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        _held[key] = [fd, 1]
        yield
    finally:
        _held.pop(key, None)
        os.close(fd)  # releases the lock; the file stays
