"""Golden vectors of the released DART implementation (fvliang/DART @13f34a5, its C++ Searcher and
TrieNgram): every tree-search case and every n-gram lookup in ../shared/paper/conformance must
match. The folder is read in place (DART_LAB_CONFORMANCE overrides); skipped with a reason when absent.

Nothing here knows the cases: the inputs go through the public API (`read_trie`, `NGram.prob`,
`topk_levels`, `tree_search`) exactly as a drafter calls it, so a fresh set drawn the same way is
checked the same way (the hidden set included)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dart_lab.ngram import read_trie
from dart_lab.search import TreeSearchConfig, topk_levels, tree_search, tree_search_with_paths


def conformance_dir() -> Path:
    env = os.environ.get("DART_LAB_CONFORMANCE")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "paper" / "conformance"


DIR = conformance_dir()
pytestmark = pytest.mark.skipif(not DIR.is_dir(), reason=f"no conformance folder at {DIR} (it ships in ../shared)")


def _sets(kind: str) -> list[Path]:
    return sorted(DIR.glob(f"{kind}_*.json")) if DIR.is_dir() else []


_tries: dict = {}


def _trie(spec: dict):
    path = DIR / spec["trie"]
    if path not in _tries:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == spec["trie_sha256"], f"{path} changed"
        _tries[path] = read_trie(path, vocab_size=spec["vocab_size"])
    return _tries[path]


def _config(c: dict) -> TreeSearchConfig:
    assert c.get("ngram_order", 3) == 3
    return TreeSearchConfig(topk=c["topk"], beam_width=c["beam_width"], max_nodes=c["max_nodes"], w_ngram=c["w_ngram"],
                            logit_decay=c["logit_decay"], level_exponent=c["level_exponent"],
                            ngram_at_level0=c["ngram_at_level0"], max_depth=c["depth"], eps=c["eps"])


def _logits(case: dict, vocab: int) -> torch.Tensor:
    """(depth, vocab) float32: the stored top-k values at their ids, -inf elsewhere (how the cases
    were fed to the released code)."""
    values = torch.tensor(case["values"], dtype=torch.float32)
    tokens = torch.tensor(case["tokens"], dtype=torch.long)
    logits = torch.full((values.shape[0], vocab), float("-inf"))
    logits.scatter_(1, tokens, values)
    return logits


def _paths(tree) -> set[tuple[int, ...]]:
    toks = tree.tokens.tolist()
    return {tuple(toks[j] for j in tree.path_to(i)[1:]) for i in range(1, len(tree))}


@pytest.mark.parametrize("path", _sets("ngram"), ids=lambda p: p.name)
def test_ngram_lookups_match_released(path):
    spec = json.loads(path.read_text())
    ng = _trie(spec)
    cases = spec["cases"]
    ctx = np.array([[c["a"], c["b"]] for c in cases], dtype=np.int64)
    tok = np.array([[c["t"]] for c in cases], dtype=np.int64)
    got = ng.prob(ctx, tok)[:, 0]
    want = np.array([c["p"] for c in cases])
    bad = [(c["id"], c["kind"], float(g), c["p"]) for c, g, w in zip(cases, got, want)
           if abs(g - w) > spec["tolerance"]]
    assert not bad, f"{len(bad)} of {len(cases)} lookups differ, e.g. {bad[:3]}"
    assert len({c["kind"] for c in cases}) >= 5  # the set exercises every back-off branch


@pytest.mark.parametrize("path", _sets("search"), ids=lambda p: p.name)
def test_tree_search_matches_released(path):
    spec = json.loads(path.read_text())
    ng = _trie(spec)
    bad = []
    for case in spec["cases"]:
        cfg = _config(case["config"])
        logp, toks = topk_levels(_logits(case, spec["vocab_size"]), cfg.topk, eps=cfg.eps)
        tree = tree_search(logp, toks, case["context"], ng, cfg, frozenset(case["eos_ids"]))
        want = {tuple(p) for p in case["expected_paths"]}
        if _paths(tree) != want:
            bad.append(case["id"])
        # the extension's entry point with nothing extra is the same released search
        if _paths(tree_search_with_paths(logp, toks, case["context"], ng, cfg, frozenset(case["eos_ids"]))) != want:
            bad.append(case["id"] + " (with_paths)")
    assert not bad, f"{len(bad)} of {len(spec['cases'])} trees differ: {bad[:10]}"
