"""The paper's hub artifacts: where each lives, the form it really has, and fetching it (online or from the
hub cache with HF_HUB_OFFLINE=1). One home for what the `paper-qwen3-*` presets read; every failure is a
one-line `DartLabError` naming the artifact and what to do.

Each artifact's form, with its source of truth (the released loader's file, or the published card):

| artifact | files | form | source of truth |
|---|---|---|---|
| target `Qwen/Qwen3-{1.7B,4B,8B,14B,32B}` | config.json, tokenizer, `model*.safetensors` (+ index) | HF causal LM, bf16 | transformers' Qwen3 |
| DART head `fvliang/qwen{1.7b,4b,8b,14b,32b}-dart` | config.json, model.safetensors | `DartHead` keys; no embed_tokens | fvliang/DART dart/model/dart_model.py |
| EAGLE-3 head `AngelSlim/Qwen3-*_eagle3` | config.json, pytorch_model.bin OR model.safetensors | `Eagle3Head` keys, fp16, d2t/t2d | fvliang/DART third_party/eagle/eagle/model/ea_model.py |
| n-gram `fvliang/dart-qwen3-ngram` | full.trie, small.trie | the released binary trie (`ngram.read_trie`) | fvliang/DART dart/tree_search/cpplib/cpp_ngram/trie_ngram.cpp |
| prompt sets (`data.HUB_DATASETS`) | parquet / json / jsonl data files | read directly, no loading script | each dataset repo's data files |

What the released loaders tolerate, and what we do:
- DART (`DartModel.from_pretrained`): reads `config.json` and `model.safetensors` (nothing else), builds
  `LlamaForCausalLMDart` whatever `architectures` says, and loads with `strict=False`; the embedding is
  copied from the target. We take the same files, ignore extra keys as it does, take the embedding from the
  target, and refuse a file that lacks any other weight (strict=False would leave it random, silently).
- EAGLE-3 (`EaModel.from_pretrained`): tries `pytorch_model.bin` first, then `model.safetensors`; any
  `model_type` (AngelSlim's configs differ between sizes); `strict=False`; when the draft vocabulary is the
  whole vocabulary, d2t / t2d are dropped (identity mapping). We do the same, with the same refusal.
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import DartLabError


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set: only the hub cache is read."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _fail(what: str, repo: str, e: Exception, file: str = "") -> DartLabError:
    """One line naming the artifact and what to do, from any huggingface_hub error."""
    name = type(e).__name__
    where = f"{repo}/{file}" if file else repo
    if name in ("EntryNotFoundError", "RemoteEntryNotFoundError") or isinstance(e, FileNotFoundError) and file:
        return DartLabError(f"{what}: {where} does not exist on the hub (wrong file name or repo layout)")
    if name in ("RepositoryNotFoundError", "GatedRepoError"):
        return DartLabError(f"{what}: hub repo {repo} not found or not accessible (check the name; `hf auth login` "
                            "for gated repos)")
    if offline() or name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled"):
        return DartLabError(f"{what}: {where} is not in the hub cache ({_cache()}) and HF_HUB_OFFLINE is set: "
                            f"run `hf download {repo}` once where the hub is reachable")
    first = (str(e).strip().splitlines() or [name])[0][:200]
    return DartLabError(f"{what}: cannot fetch {where} from the hub ({first})")


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def fetch_file(repo: str, file: str, what: str, repo_type: str = "model") -> Path:
    """One file of a hub repo (downloaded once, then from the cache)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, file, repo_type=repo_type))
    except Exception as e:  # network, auth, a missing entry, offline without the file: all end in one line
        raise _fail(what, repo, e, file) from None


def fetch_snapshot(repo: str, what: str, patterns: list[str] | None = None, repo_type: str = "model") -> Path:
    """The snapshot folder of a hub repo, restricted to `patterns` (glob) when given."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, repo_type=repo_type, allow_patterns=patterns))
    except Exception as e:
        raise _fail(what, repo, e) from None


def resolve(spec: str, what: str = "artifact") -> Path:
    """A local path as is; "org/name" -> its snapshot folder; "hub:org/name/FILE" (or "org/name/FILE") -> that
    file. Anything else: a one-line error."""
    spec = spec[len("hub:"):] if spec.startswith("hub:") else spec
    p = Path(spec).expanduser()
    if p.exists():
        return p
    parts = spec.split("/")
    if len(parts) < 2 or spec.startswith((".", "/")) or not all(parts):
        raise DartLabError(f"{what}: {spec} is neither a local path nor a hub repo (org/name[/file])")
    repo = "/".join(parts[:2])
    return fetch_file(repo, "/".join(parts[2:]), what) if len(parts) > 2 else fetch_snapshot(repo, what)
