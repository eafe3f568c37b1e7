"""Atomic writes: everything dart_lab stores (caches, shards, checkpoints, results) is built under a
temporary sibling name and renamed into place, so an interrupted run never leaves a half-written
file; the temporary is removed on error. Files get the usual permissions (0666 / 0777 minus umask),
not mkstemp's private 0600."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


@contextmanager
def atomic_file(path: str | Path, suffix: str = ".tmp"):
    """with atomic_file(p) as tmp: write tmp (a str path) -> it replaces p when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextmanager
def atomic_dir(path: str | Path):
    """with atomic_dir(d) as tmp: fill the folder tmp (a Path) -> it replaces d when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | Path, obj, indent: int | None = 1) -> None:
    with atomic_file(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=indent)
