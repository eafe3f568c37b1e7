"""Named reproduction presets: which target, heads, n-gram table and datasets a run uses.

`embedded` runs on any CPU with the shipped heads. The `paper-qwen3-*` presets reproduce the paper's
Table 1 setting on a GPU box with hub access: Qwen3 targets, the authors' DART weights
(fvliang/qwen*-dart), their n-gram trie (fvliang/dart-qwen3-ngram) and community EAGLE-3 weights
(AngelSlim/Qwen3-*_eagle3), as listed in the paper and its released code.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import DartLabError
from .methods import MethodOptions

PAPER_DATASETS = ("hub:alpaca", "hub:code_alpaca", "hub:humaneval", "hub:livecodebench", "hub:math500", "hub:mbpp",
                  "mt_bench")


@dataclass(frozen=True)
class Preset:
    name: str
    model: str
    dart_head: str = ""  # "" = the shipped head; "org/name" = hub repo; else a local folder
    eagle3_head: str = ""
    ngram: str = "sharegpt"  # sharegpt | jsonl:PATH | FILE.npz | FILE.trie | hub:REPO/FILE.trie
    datasets: tuple = ("mt_bench", "humaneval")
    paper_model: str = ""  # the row of the paper's tables to compare with
    dtype: str = "auto"
    batch_sizes: tuple = (1, 2, 4, 8, 16)  # Tables 5-7 (throughput by batch size); `make reproduce` runs a small grid

    def options(self, **kw) -> MethodOptions:
        return MethodOptions(dart_head=self.dart_head, eagle3_head=self.eagle3_head, ngram=self.ngram, **kw)


def _paper(size: str, dart: str) -> Preset:
    return Preset(name=f"paper-qwen3-{size}", model=f"Qwen/Qwen3-{size.upper()}", dart_head=f"fvliang/{dart}",
                  eagle3_head=f"AngelSlim/Qwen3-{size.upper()}_eagle3", ngram="hub:fvliang/dart-qwen3-ngram/full.trie",
                  datasets=PAPER_DATASETS, paper_model=f"qwen3-{size}", batch_sizes=(1, 2, 4, 8, 16, 24, 32, 48, 64))


PRESETS = {
    "embedded": Preset(name="embedded", model="smollm2-135m",
                       datasets=("mt_bench", "humaneval", "gsm8k", "code_alpaca", "alpaca"), paper_model="qwen3-1.7b"),
    "paper-qwen3-1.7b": _paper("1.7b", "qwen1.7b-dart"),
    "paper-qwen3-4b": _paper("4b", "qwen4b-dart"),
    "paper-qwen3-8b": _paper("8b", "qwen8b-dart"),
    "paper-qwen3-14b": _paper("14b", "qwen14b-dart"),
    "paper-qwen3-32b": _paper("32b", "qwen32b-dart"),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise DartLabError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
