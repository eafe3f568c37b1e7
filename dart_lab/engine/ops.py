"""The engine's versions of the method's ops, plugged into `dart_lab.fast` on import: each runs our C++ kernel
(`kernels`, csrc/) where it is built and takes these inputs, else returns None and the method's reference runs.
Every one equals its reference (bit for bit, or to fp32 rounding where stated): tests/test_search.py,
tests/test_tree.py, tests/test_paper_presets.py, tests/test_fast_runner.py, tests/test_drafters.py.
"""
from __future__ import annotations

import functools
import weakref

import numpy as np
import torch

from .. import fast
from ..errors import DartLabError
from ..ngram import NGram
from ..search import TreeSearchConfig, _scoring, _search
from . import kernels

_NO_TABLES = (torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.int32),
              torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.int32), 0)
_NO_LOCAL = (*_NO_TABLES[:5], 0.0)  # no request-local n-gram mixed in


def compiled_search_reads(ngram) -> bool:
    """Whether the compiled search runs here for this n-gram: an `NGram`, none, or dart-ctx's mix of one with
    the request's own (`compiles`: it hands its `tables` and `local_tables` over, csrc/search.cpp)."""
    return (ngram is None or type(ngram) is NGram or getattr(ngram, "compiles", False)) and kernels.search_here()


@functools.lru_cache(maxsize=64)
def _level_weights(level_exponent: float, logit_decay: float, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_level, w_logit) of levels 0..D-1 as float32 tensors, as the numpy loop rounds them."""
    f32 = np.float32
    return (torch.tensor([f32((lvl + 1) ** -level_exponent) for lvl in range(D)], dtype=torch.float32),
            torch.tensor([f32(logit_decay ** lvl) for lvl in range(D)], dtype=torch.float32))


def beam_candidates(logp, tokens, context, ngram, cfg: TreeSearchConfig, eos_ids, D: int, beam_width: int):
    """`search._levels` through `dart_lab::beam_candidates` (csrc/search.cpp, the same numbers bit for bit)."""
    if not compiled_search_reads(ngram):
        return None
    logp, eos, use_ng, w_ng, eps = _scoring(cfg, logp, ngram, eos_ids)
    w_level, w_logit = _level_weights(cfg.level_exponent, cfg.logit_decay, D)
    tables = ngram.tables() if use_ng else _NO_TABLES
    local = ngram.local_tables() if use_ng and hasattr(ngram, "local_tables") else _NO_LOCAL
    out = torch.ops.dart_lab.beam_candidates(
        torch.from_numpy(np.ascontiguousarray(logp[:D])), torch.from_numpy(np.ascontiguousarray(tokens[:D], np.int64)),
        torch.from_numpy(eos), int(context[-2]) if len(context) >= 2 else -1, int(context[-1]), w_level, w_logit,
        beam_width, use_ng, cfg.ngram_at_level0, float(w_ng), float(eps), *tables, *local)
    return tuple(t.numpy() for t in out)


def tree_search_batch(logp, tokens, contexts, ngram, cfg: TreeSearchConfig, eos_ids):
    """`search.tree_search_batch` as one compiled search a row: each row's level loop compiled costs less than
    the reference's one shared numpy pass over every row."""
    if not compiled_search_reads(ngram):
        return None
    return [_search(logp[r], tokens[r], contexts[r], ngram, cfg, eos_ids, nodes=False) for r in range(logp.shape[0])]


def closed_tree(parents, scores, depths, max_nodes: int):
    """`tree.best_closed_tree`'s selection through `dart_lab::closed_tree` (csrc/search.cpp, the same selection):
    (chosen, rank, parent position) as numpy arrays."""
    if not kernels.search_here():
        return None
    out = torch.ops.dart_lab.closed_tree(torch.from_numpy(np.ascontiguousarray(parents, np.int64)),
                                         torch.from_numpy(np.ascontiguousarray(scores, np.float64)),
                                         torch.from_numpy(np.ascontiguousarray(depths, np.int64)), int(max_nodes))
    return tuple(t.numpy() for t in out)


def trie_nodes(buf: np.ndarray, path):
    """`ngram._trie_nodes`' walk of a released .trie file in C++ (csrc/trie.cpp) over its mapped bytes."""
    if not kernels.trie_here():
        return None
    try:
        token, parent, freq, order = torch.ops.dart_lab.trie_nodes(torch.from_numpy(buf))
    except RuntimeError as e:
        raise DartLabError(f"{path}: {str(e).splitlines()[0]}; not a complete DART .trie file") from None
    return token.numpy(), parent.numpy(), freq.numpy(), order


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """The draft head's RMSNorm as one pass (`dart_lab::rms_norm`: the same formula, its sum of squares in
    another order, to fp32 rounding) for fp32 CPU tensors without gradients, outside a compiled graph."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
            and not grad and not torch.compiler.is_compiling() and kernels.rms_norm_here()):
        return torch.ops.dart_lab.rms_norm.default(x, weight, eps)
    return None


def top2(logits: torch.Tensor):
    """`generate.top2`'s (top-2 values, argmax) of fp32 CPU logits in one pass (`dart_lab::top2`)."""
    if (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
            and logits.shape[-1] >= 2 and logits.is_contiguous() and kernels.top2_here()):
        return torch.ops.dart_lab.top2(logits)
    return None


_device_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # NGram -> {device: DeviceNGram}
SEARCH_ON_DEVICE = ("cuda",)  # device types whose batches search on the device (tests add "cpu")


def propose_rows(logits: torch.Tensor, contexts: list[list[int]], drafter):
    """`drafters.propose_rows`' top-k and search for a batch whose head logits (R, L, V) live on a GPU: both on the
    device (`on_device.search_batch`: the reference's trees), one host copy of the trees a step. On a CPU the
    compiled per-row search is faster (docs/speed.md), so the reference path runs there."""
    from .on_device import DeviceNGram, search_batch, trees

    ng = drafter.ngram
    if logits.device.type not in SEARCH_ON_DEVICE or not (ng is None or type(ng) is NGram):
        return None
    cfg = drafter.search
    vals, idx = torch.topk(logits.float(), cfg.topk, dim=-1)
    p = torch.softmax(vals, dim=-1)
    if drafter.vocab_map is not None:
        idx = drafter.vocab_map.to(idx.device)[idx]
    logp = torch.log(p + 1e-10)  # `search.topk_levels`' eps
    dev_ng = None
    if ng is not None:  # the tables copied to the device once
        held = _device_tables.setdefault(ng, {})
        dev_ng = held.get(logits.device) or held.setdefault(logits.device, DeviceNGram(ng, logits.device))
    last2 = torch.tensor([[c[-2] if len(c) >= 2 else -1, c[-1]] for c in contexts], device=logits.device)
    return trees(search_batch(logp, idx, last2, dev_ng, cfg, drafter.eos))


for _name in ("beam_candidates", "tree_search_batch", "closed_tree", "trie_nodes", "rms_norm", "top2", "propose_rows"):
    fast.plug(_name, globals()[_name])
