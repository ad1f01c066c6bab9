"""Flag checks shared by the dry run and the real run: run before any file changes or any paid call."""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from errors import DataError  # splice: drop


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_number(dest: str, value, *, low=None, high=None, low_open=False, high_open=False) -> None:
    """DataError unless value is a finite number within [low, high] (open ends where asked); None passes."""
    if value is None:
        return
    name = flag_name(dest)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{name} {value!r}: expected a finite number")
    bounds = (f"{'(' if low_open else '['}{'-inf' if low is None else low}, "
              f"{'inf' if high is None else high}{')' if high_open else ']'}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise DataError(f"{name} {value}: expected a value in {bounds}")


def check_numbers(args, rules: dict) -> None:
    """rules: {dest: dict(low=..., high=..., low_open=..., high_open=...)} checked against args.dest."""
    for dest, bounds in rules.items():
        check_number(dest, getattr(args, dest, None), **bounds)


def check_readable_file(path, what: str) -> Path:
    """An existing, readable file, or DataError naming the flag and the file."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {path}: no such file")
    if p.is_dir():
        raise DataError(f"{what} {path} is a folder; expected a file")
    if not os.access(p, os.R_OK):
        raise DataError(f"{what} {path} is not readable (permissions)")
    return p


def check_writable_dir(path, what: str) -> Path:
    """A folder that exists and is writable, or can be created under a writable parent."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise DataError(f"{what} {path} is a file; expected a folder (choose another {what})")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise DataError(f"{what} {path}: {probe} is a file, so the folder cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise DataError(f"{what} {path}: {probe} is not writable (permissions)")
    return p


def check_free_space(path, need_bytes: int, what: str, fix: str) -> None:
    """DataError when the disk that holds `path` (or its nearest existing parent) has less than need_bytes
    free: checked before any paid call, so a full disk never stops a run midway."""
    probe = Path(path).expanduser()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # cannot tell: the write itself will say
    if free < need_bytes:
        raise DataError(f"{what} needs about {need_bytes / 2**20:,.0f} MiB on the disk of {path} and "
                        f"{free / 2**20:,.0f} MiB are free; {fix}")
