"""The method's ops that the engine runs faster: a table from op name to function, which the method's files
ask and the engine (`dart_lab/engine/ops.py`) fills when it is imported (`import dart_lab` does).

Each entry takes the reference's arguments and returns the reference's result, or None where it cannot run
(its kernel is not built on this machine, or it does not take these inputs); the reference then runs. So the
method's files never import the engine, and without it every op runs its reference: the oracle the tests hold
each fast path to.
"""
from __future__ import annotations

from typing import Callable

_OPS: dict[str, Callable] = {}


def plug(name: str, fn: Callable) -> None:
    """Register `fn` as the faster version of the method's op `name`."""
    _OPS[name] = fn


def call(name: str, *args):
    """The plugged version of `name` on `args`, or None where none is plugged or it cannot run them."""
    fn = _OPS.get(name)
    return None if fn is None else fn(*args)
