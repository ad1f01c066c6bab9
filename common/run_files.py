"""A run folder's files at the lowest level, carried by every script that reads or writes one (the report
tool too): JSONL lines as editors save them, and the one-writer lock.

The lock: an exclusive advisory POSIX record lock (lockf) on LOG/.lock, held for the writer's whole life.
The kernel drops it when its process ends, however it ends (SIGKILL too), and forked workers (the render
pool) do not inherit it. The file says who holds it (pid, host, script, start time) for the error a second
writer prints and for readers (tinker_report.py), which never take the lock: they test it for an instant.
A record left by a process that died holding the lock is taken over by the next writer, which says so.
Within one process a POSIX lock never conflicts with itself and closing any descriptor of the file drops
it: only the lock's own code opens LOG/.lock.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the scripts run, unguarded
    fcntl = None

LOCK_FILE = ".lock"
# A reader tests the lock for microseconds and a writer records itself right after taking it: a refused
# writer that finds no live holder named in the file tries again for this long before giving up.
SETTLE_S = 2.0


def jsonl_lines(text: str):
    """(line number, line) of each non-blank line of JSONL text: a UTF-8 byte-order mark (Windows editors,
    also where files were concatenated) and CRLF endings are accepted, as pandas and datasets accept them;
    only a newline ends a line (U+2028 and other characters str.splitlines() splits on are valid inside a
    JSON string)."""
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.strip().lstrip("\ufeff")
        if line:
            yield n, line


class FolderBusy(Exception):
    """A live process holds the folder's lock; `holder` is its record ({} when unreadable)."""

    def __init__(self, holder: dict):
        super().__init__(describe_holder(holder))
        self.holder = holder


def describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "another process (it has not recorded itself yet)"
    return (f"{holder.get('script') or 'a script'} (pid {holder['pid']} on host {holder.get('host')}, "
            f"since {holder.get('started')})")


def read_holder(fd) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        record = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def holder_alive(holder: dict) -> bool | None:
    """Whether the recorded process still runs: True/False on this host, None for another host."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_file(fd, path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def acquire_lock(folder) -> tuple[int | None, dict]:
    """(descriptor holding FOLDER/.lock, the record of a dead holder taken over or {}). Creates the folder.
    FolderBusy when a live process holds it. Release with release_lock(fd, folder)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        return None, {}
    path = folder / LOCK_FILE
    deadline = time.monotonic() + SETTLE_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = read_holder(fd)
            os.close(fd)
            if holder_alive(holder) or time.monotonic() > deadline:
                raise FolderBusy(holder) from None
            time.sleep(0.05)
            continue
        if not _same_file(fd, path):  # released and removed between our open and lock: lock the new file
            os.close(fd)
            continue
        previous = read_holder(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "script": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else None,
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return fd, previous


def release_lock(fd, folder) -> None:
    """Remove FOLDER/.lock (if it is still ours) and drop the lock."""
    if fd is None:
        return
    path = Path(folder) / LOCK_FILE
    try:
        if _same_file(fd, path):
            path.unlink()
    except OSError:
        pass
    os.close(fd)


def lock_holder(folder) -> dict | None:
    """The record of the live process holding FOLDER/.lock, or None. Never waits and never blocks a writer
    for longer than an instant (a writer refused meanwhile tries again). Not for use by the holder itself."""
    if fcntl is None:
        return None
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return read_holder(fd) or {"pid": None}
        return None
    finally:
        os.close(fd)
