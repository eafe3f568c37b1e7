"""Named reproduction presets: which target, heads, n-gram table and datasets a run uses.

`embedded` runs on any CPU with the shipped heads. The `paper-qwen3-*` presets reproduce the paper's
Table 1 setting on a GPU box with hub access (or a filled hub cache and HF_HUB_OFFLINE=1): Qwen3 targets, the
authors' DART weights (fvliang/qwen*-dart), their n-gram trie (fvliang/dart-qwen3-ngram) and community EAGLE-3
weights (AngelSlim/Qwen3-*_eagle3), as listed in the paper and its released code; each artifact's form is in
`hub.py`. One command per preset: `make reproduce PRESET=paper-qwen3-4b`.

GPU memory (bf16, loaded straight onto the device, `loading.load_dtype`): the weights are 2 bytes a parameter
(`QWEN3_PARAMS`); the KV cache adds 2 x layers x 8 KV heads x 128 x 2 bytes a token and row. The paper's batch
grid runs to 64 rows for Tables 5-7 (Qwen3-4B and -8B in the paper); the 32B preset stops at 16 rows, where
weights + cache stay within one 80 GB GPU (README, "GPU box").
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
    batch_sizes: tuple = (1, 2, 4, 8, 16)  # Tables 5-7 (throughput by batch size)
    batch_grid: str = "small"  # the grid run by default: "small" (batch <= 8, 8 prompts) | "full" (batch_sizes, 16)

    def options(self, **kw) -> MethodOptions:
        """The methods' options of this preset, `kw` overriding (e.g. ngram=... for small.trie)."""
        return MethodOptions(**{"dart_head": self.dart_head, "eagle3_head": self.eagle3_head, "ngram": self.ngram, **kw})


PAPER_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # Tables 5-7's grid (paper: 2-64) and batch 1
# parameters of the Qwen3 targets (their model cards), for the memory each preset needs
QWEN3_PARAMS = {"1.7b": 2.03e9, "4b": 4.02e9, "8b": 8.19e9, "14b": 14.8e9, "32b": 32.8e9}
QWEN3_LAYERS = {"1.7b": 28, "4b": 36, "8b": 36, "14b": 40, "32b": 64}


def gpu_memory_gb(size: str, rows: int = 1, tokens: int = 2048) -> float:
    """bf16 weights + KV cache of `rows` x `tokens` (8 KV heads of 128 in every Qwen3 size), in GB."""
    return (2 * QWEN3_PARAMS[size] + rows * tokens * 2 * QWEN3_LAYERS[size] * 8 * 128 * 2) / 1e9


def _paper(size: str, dart: str, batch_sizes: tuple = PAPER_BATCHES) -> Preset:
    return Preset(name=f"paper-qwen3-{size}", model=f"Qwen/Qwen3-{size.upper()}", dart_head=f"fvliang/{dart}",
                  eagle3_head=f"AngelSlim/Qwen3-{size.upper()}_eagle3", ngram="hub:fvliang/dart-qwen3-ngram/full.trie",
                  datasets=PAPER_DATASETS, paper_model=f"qwen3-{size}", batch_sizes=batch_sizes, batch_grid="full")


PRESETS = {
    "embedded": Preset(name="embedded", model="smollm2-135m",
                       datasets=("mt_bench", "humaneval", "gsm8k", "code_alpaca", "alpaca"), paper_model="qwen3-1.7b"),
    "paper-qwen3-1.7b": _paper("1.7b", "qwen1.7b-dart"),
    "paper-qwen3-4b": _paper("4b", "qwen4b-dart"),
    "paper-qwen3-8b": _paper("8b", "qwen8b-dart"),
    "paper-qwen3-14b": _paper("14b", "qwen14b-dart"),
    "paper-qwen3-32b": _paper("32b", "qwen32b-dart", batch_sizes=(1, 2, 4, 8, 16)),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise DartLabError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
