"""Notebook exercises: an answer cell that never fails (a hint while unanswered), and hidden solution
cells that the tests run (`DART_LAB_SOLUTIONS=1`, set by `make test`) and a reader does not."""
from __future__ import annotations

import os


def check(answer, truth, hint: str, tol: float | None = None, explain: str = "") -> bool:
    """Print a hint while `answer` is None, "correct" when it equals `truth` (numbers: within a relative
    `tol`), else "not quite" and the hint. Returns whether it matched; never raises."""
    if answer is None:
        print("your turn: replace None with your answer and run this cell again. Hint:", hint)
        return False
    try:
        ok = abs(answer - truth) <= tol * abs(truth) if tol is not None else answer == truth
    except TypeError:
        ok = False
    print(f"correct: {explain}" if ok else f"not quite ({answer!r}). Hint: {hint}")
    return bool(ok)


def solutions() -> bool:
    """Whether a notebook's solution cells run: DART_LAB_SOLUTIONS=1 (the tests); off for a reader."""
    return os.environ.get("DART_LAB_SOLUTIONS") == "1"
