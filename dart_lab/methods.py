"""Method registry: build any decoding method by name for a target.

Heads: an explicit path, else the trained heads shipped for the embedded target
(dart_lab/heads/<target>/{dart,eagle3}), else — only when asked with `random_heads=True`, for
plumbing tests — freshly initialised heads (correct but useless drafts; results say so).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import DartLabError

METHODS = ("ar", "dart", "dart-no-ngram", "eagle3", "pld", "sps", "hf", "hf-pld")
HEADS_DIR = Path(__file__).resolve().parent / "heads"


@dataclass(frozen=True)
class MethodOptions:
    dart_head: str = ""  # folder with config.json + model.safetensors; "" = shipped default
    eagle3_head: str = ""
    ngram: str = "sharegpt"  # 'sharegpt', 'jsonl:PATH', an .npz or an official .trie file
    ngram_max_tokens: int = 0  # 0 = the whole corpus
    sps_model: str = ""  # HF id/path of a smaller LM with the target's tokenizer
    sps_draft_len: int = 5
    random_heads: bool = False
    pld_max_ngram: int = 3
    pld_num_pred: int = 10
    draft_length: int = 0  # 0 = the head's own
    tree_nodes: int = 0  # 0 = the search config's default (60)


def shipped_head(target, kind: str) -> Path | None:
    p = HEADS_DIR / target.name / kind
    return p if (p / "config.json").is_file() else None


def random_head(target, kind: str, seed: int = 0, draft_length: int = 7, shifted: bool = True):
    from .draft_head import DartHead, HeadConfig
    from .eagle3 import Eagle3Head

    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(target.model.config, draft_vocab_size=min(target.vocab_size, 8192),
                                draft_length=draft_length, shifted=shifted)
    head = (DartHead if kind == "dart" else Eagle3Head)(cfg)
    head.set_vocab(torch.arange(cfg.draft_vocab_size))
    head.attach_embedding(target.model.get_input_embeddings())
    return head.to(device=target.device, dtype=target.dtype).eval()


def load_head(target, kind: str, path: str, random_heads: bool):
    from .draft_head import DartHead
    from .eagle3 import Eagle3Head

    from .assets import resolve_hub

    cls = DartHead if kind == "dart" else Eagle3Head
    if path:
        return cls.load(resolve_hub(path), target=target)
    shipped = shipped_head(target, kind)
    if shipped is not None:
        return cls.load(shipped, target=target)
    if random_heads:
        return random_head(target, kind)
    raise DartLabError(f"no {kind} head for target {target.name!r}: pass --{kind}-head PATH "
                       f"(train one with `dart-lab train {kind}`) or --random-heads for a plumbing run")


def load_ngram_for(target, spec: str, max_tokens: int = 0):
    from .assets import resolve_hub
    from .ngram import NGram, build_ngram

    if spec.endswith((".npz", ".trie")):
        path = resolve_hub(spec) if spec.startswith("hub:") else Path(spec)
        if not path.is_file():
            raise DartLabError(f"n-gram file not found: {spec}")
        return NGram.load(path, vocab_size=target.vocab_size)
    if target.tokenizer is None:
        raise DartLabError("building an n-gram table needs the target's tokenizer")
    return build_ngram(target.tokenizer, spec, max_tokens=max_tokens or None)


def make_drafter(name: str, target, opts: MethodOptions = MethodOptions(), cache: dict | None = None):
    """A Drafter for `name` (None for 'ar'); 'hf' and 'hf-pld' are run by hf_generate instead.
    `cache` (dict) shares heavy objects (heads, n-gram table) between methods of one run."""
    from .drafters import DartDrafter, PLDDrafter, SPSDrafter
    from .eagle3 import Eagle3Drafter, Eagle3TreeConfig
    from .search import TreeSearchConfig

    cache = {} if cache is None else cache
    if name not in METHODS:
        raise DartLabError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    if name in ("ar", "hf", "hf-pld"):
        return None
    if name == "pld":
        return PLDDrafter(opts.pld_max_ngram, opts.pld_num_pred)
    if name in ("dart", "dart-no-ngram"):
        if "dart_head" not in cache:
            cache["dart_head"] = load_head(target, "dart", opts.dart_head, opts.random_heads)
        head = cache["dart_head"]
        if opts.draft_length:
            head.cfg = dataclasses.replace(head.cfg, draft_length=opts.draft_length)
        search = TreeSearchConfig(max_nodes=opts.tree_nodes) if opts.tree_nodes else TreeSearchConfig()
        if name == "dart-no-ngram":
            return DartDrafter(head, None, dataclasses.replace(search, w_ngram=0.0), name="dart-no-ngram")
        if "ngram" not in cache:
            cache["ngram"] = load_ngram_for(target, opts.ngram, opts.ngram_max_tokens)
        return DartDrafter(head, cache["ngram"], search)
    if name == "eagle3":
        if "eagle3_head" not in cache:
            cache["eagle3_head"] = load_head(target, "eagle3", opts.eagle3_head, opts.random_heads)
        tree = Eagle3TreeConfig(total_tokens=opts.tree_nodes) if opts.tree_nodes else Eagle3TreeConfig()
        return Eagle3Drafter(cache["eagle3_head"], tree)
    if name == "sps":
        if not opts.sps_model:
            raise DartLabError("sps needs a draft model: pass --sps-model ID_OR_PATH")
        if "sps" not in cache:
            from .target import Target, load_target

            draft = load_target(opts.sps_model, device=str(target.device), dtype=target.dtype)
            cache["sps"] = draft if isinstance(draft, Target) else Target(draft)
        if cache["sps"].vocab_size > target.vocab_size:
            raise DartLabError(f"sps draft vocabulary ({cache['sps'].vocab_size}) exceeds the target's ({target.vocab_size})")
        return SPSDrafter(cache["sps"], opts.sps_draft_len)
    raise AssertionError(name)
