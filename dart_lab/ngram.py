"""Order-3 n-gram model for n-gram-enforced continuity in the tree search (paper section 3.2).

p(t | a, b) = count(a, b, t) / count(a, b)   if the trigram (a, b, t) was seen,
            = count(b, t) / count(b)         else if the bigram (b, t) was seen,
            = 0                              otherwise (no smoothing; the search adds 1e-10).
Back-off is decided PER TOKEN, as the released `TrieNgram.get_probability` does (paper/METHOD.md "Tree
search"): an unseen trigram of a seen context (a, b) backs off to the bigram; it does not get 0.
When the context has one token only (a = -1), the bigram estimate is used.

Counts are stored as sorted int64 keys (a*V + b)*V + t with uint32 counts, so a batch of lookups is
two `np.searchsorted` calls: fast enough to score 20 x 25 candidates per level in microseconds.

Sources: any token sequences (default: the packaged ShareGPT conversations tokenised with the target
tokenizer), or the official binary `.trie` files (fvliang/dart-qwen3-ngram):
    size_t order, size_t node_count, then per node:
    int32 token, size_t parent, int32 freq, size_t n_children, n_children x (int32 token, size_t id)
(native little-endian; node 0 is the root; a node at depth k holds the count of a k-gram).
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from . import fast
from .assets import cache_dir
from .atomic import atomic_file
from .data import _read_jsonl, iter_sharegpt
from .errors import DartLabError


class NGram:
    """Unigram, bigram and trigram counts over a vocabulary of size V."""

    def __init__(self, vocab_size: int, uni: tuple, bi: tuple, tri: tuple, meta: dict | None = None):
        self.V = int(vocab_size)
        self.uni_keys, self.uni_counts = uni
        self.bi_keys, self.bi_counts = bi
        self.tri_keys, self.tri_counts = tri
        self.meta = meta or {}

    # -- building
    @classmethod
    def from_sequences(cls, seqs, vocab_size: int, meta: dict | None = None) -> "NGram":
        """Count every 1/2/3-gram inside each sequence (no n-gram crosses a sequence boundary)."""
        V = np.int64(vocab_size)
        parts = {1: [], 2: [], 3: []}
        for s in seqs:
            a = np.asarray(s, dtype=np.int64)
            if a.size == 0:
                continue
            if a.min() < 0 or a.max() >= V:
                raise DartLabError(f"token id outside the vocabulary (size {vocab_size}) in the n-gram corpus")
            parts[1].append(a)
            if a.size >= 2:
                parts[2].append(a[:-1] * V + a[1:])
            if a.size >= 3:
                parts[3].append((a[:-2] * V + a[1:-1]) * V + a[2:])
        tables = []
        for k in (1, 2, 3):
            if parts[k]:
                keys, counts = np.unique(np.concatenate(parts[k]), return_counts=True)
            else:
                keys, counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
            tables.append((keys.astype(np.int64), counts.astype(np.uint32)))
        return cls(vocab_size, *tables, meta=meta)

    # -- lookups
    @staticmethod
    def _count(keys: np.ndarray, counts: np.ndarray, q: np.ndarray) -> np.ndarray:
        if keys.size == 0:
            return np.zeros(q.shape, np.float64)
        idx = np.minimum(np.searchsorted(keys, q), keys.size - 1)
        return np.where(keys[idx] == q, counts[idx], 0).astype(np.float64)

    @property
    def _uni_dense(self) -> np.ndarray:
        """(V,) unigram counts, built on first use: O(1) lookups for the back-off denominator."""
        if getattr(self, "_uni_cache", None) is None:
            d = np.zeros(self.V, np.float64)
            d[self.uni_keys] = self.uni_counts
            self._uni_cache = d
        return self._uni_cache

    def tables(self) -> tuple:
        """The tables as `dart_lab::beam_candidates` reads them (csrc/search.cpp): dense unigram counts, the
        bigram and trigram keys and counts (uint32 counts as int32 of the same bits), V; torch views of the
        arrays, no copies."""
        if getattr(self, "_tables", None) is None:
            import torch

            def counts(c):
                return torch.from_numpy(np.ascontiguousarray(c, dtype=np.uint32).view(np.int32))

            self._tables = (torch.from_numpy(self._uni_dense), torch.from_numpy(np.ascontiguousarray(self.bi_keys, np.int64)),
                            counts(self.bi_counts), torch.from_numpy(np.ascontiguousarray(self.tri_keys, np.int64)),
                            counts(self.tri_counts), self.V)
        return self._tables

    def prob(self, ctx: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """ctx (B, 2) int64 last two tokens (-1 where absent, e.g. at the start); tokens (B, K).
        Returns p(tokens | ctx) (B, K) float64 with per-token back-off (module docstring).
        Two binary searches per call: bigram table (context counts and back-off counts together),
        then trigram table."""
        V = np.int64(self.V)
        ctx = np.asarray(ctx, dtype=np.int64)
        t = np.asarray(tokens, dtype=np.int64)
        B, K = t.shape
        a, b = ctx[:, 0], ctx[:, 1]
        b0 = np.maximum(b, 0)
        c_b = np.where(b >= 0, self._uni_dense[b0], 0.0)  # count(b)
        q_bi = np.concatenate([np.maximum(a, 0) * V + b0, (b0[:, None] * V + t).ravel()])
        cnt = self._count(self.bi_keys, self.bi_counts, q_bi)
        c_ab = np.where((a >= 0) & (b >= 0), cnt[:B], 0.0)  # count(a, b)
        c_bt = np.where((b >= 0)[:, None], cnt[B:].reshape(B, K), 0.0)  # count(b, t)
        out = np.where(c_bt > 0, c_bt / np.maximum(c_b, 1.0)[:, None], 0.0)  # bigram estimate
        # a seen trigram (a, b, t) needs a seen context (a, b) and a seen bigram (b, t): look up only those
        r, k = np.nonzero((c_ab > 0)[:, None] & (c_bt > 0))
        if r.size:
            c_abt = self._count(self.tri_keys, self.tri_counts, (a[r] * V + b[r]) * V + t[r, k])
            seen = c_abt > 0
            out[r[seen], k[seen]] = c_abt[seen] / c_ab[r[seen]]  # the trigram wins where it was seen
        return out

    @property
    def num_ngrams(self) -> dict:
        return {"unigrams": int(self.uni_keys.size), "bigrams": int(self.bi_keys.size), "trigrams": int(self.tri_keys.size)}

    # -- persistence
    def save(self, path: str | Path) -> Path:
        """Atomic .npz write."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path, suffix=".tmp.npz") as tmp:  # .npz: numpy would append it otherwise
            np.savez(tmp, V=np.int64(self.V), uni_keys=self.uni_keys, uni_counts=self.uni_counts,
                     bi_keys=self.bi_keys, bi_counts=self.bi_counts, tri_keys=self.tri_keys,
                     tri_counts=self.tri_counts, meta=np.frombuffer(json.dumps(self.meta).encode(), np.uint8))
        return path

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> "NGram":
        """An .npz written by `save`, or an official .trie (vocab_size = the target's)."""
        path = Path(path)
        if path.suffix == ".trie":
            return read_trie(path, vocab_size)
        try:
            z = np.load(path)
            meta = json.loads(bytes(z["meta"]).decode()) if "meta" in z else {}
            return cls(int(z["V"]), (z["uni_keys"], z["uni_counts"]), (z["bi_keys"], z["bi_counts"]),
                       (z["tri_keys"], z["tri_counts"]), meta=meta)
        except (OSError, KeyError, ValueError) as e:
            raise DartLabError(f"cannot read n-gram file {path}: {e}") from None


class LocalNGram:
    """The request-local n-gram of dart-ctx (dart_ctx.ContextDrafter): `NGram`'s counts and per-token
    back-off over ONE growing sequence (prompt + committed tokens), kept as successor dictionaries and
    updated in place as tokens are committed. `prob` equals `NGram.from_sequences([seq], V).prob`
    (tests/test_ngram.py). Why not rebuild an NGram each step: that is a sort of the whole sequence plus
    an O(V) table per step (a few % of a step at 1,500 context tokens); extending is
    O(new tokens), and a few hundred lookups in small dictionaries are cheaper than binary searches."""

    def __init__(self, seq=()):
        self.seq: list[int] = []
        self.uni: dict[int, int] = {}  # count(b)
        self.next1: dict[int, dict[int, int]] = {}  # b -> {t: count(b, t)}
        self.next2: dict[tuple[int, int], dict[int, int]] = {}  # (a, b) -> {t: count(a, b, t)}
        self.max_id = -1  # the largest token counted (which vocabularies the counts fit: `tables`)
        self.extend(seq)

    def extend(self, tokens) -> None:
        """Append `tokens` to the sequence and count the n-grams they end."""
        s, uni, n1, n2 = self.seq, self.uni, self.next1, self.next2
        for t in map(int, tokens):
            uni[t] = uni.get(t, 0) + 1
            self.max_id = max(self.max_id, t)
            if s:
                d = n1.setdefault(s[-1], {})
                d[t] = d.get(t, 0) + 1
                if len(s) >= 2:
                    d = n2.setdefault((s[-2], s[-1]), {})
                    d[t] = d.get(t, 0) + 1
            s.append(t)

    def sync(self, ids: list[int]) -> None:
        """Catch up with `ids`, the same sequence grown at its end (the decode loop only appends)."""
        if len(ids) > len(self.seq):
            self.extend(ids[len(self.seq):])

    def tables(self, vocab_size: int) -> tuple:
        """The counts as `NGram.tables` over a vocabulary of `vocab_size` (this `prob` equals that NGram's), for the
        compiled search; built again only when the sequence has grown."""
        if getattr(self, "_tables", None) is None or self._tables[0] != (len(self.seq), vocab_size):
            self._tables = ((len(self.seq), vocab_size), NGram.from_sequences([self.seq], vocab_size).tables()[:5])
        return self._tables[1]

    def prob(self, ctx: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """ctx (B, 2), tokens (B, K) -> p (B, K) float64, as `NGram.prob`."""
        ctx = np.asarray(ctx, dtype=np.int64).tolist()
        t = np.asarray(tokens, dtype=np.int64)
        out = np.zeros(t.shape, np.float64)
        for r, ((a, b), row) in enumerate(zip(ctx, t.tolist())):
            n1 = self.next1.get(b) if b >= 0 else None
            if not n1:  # no bigram (b, .) seen: no trigram either
                continue
            c_b = max(self.uni.get(b, 0), 1)
            n2 = self.next2.get((a, b)) if a >= 0 else None
            if n2:  # context (a, b) seen: a seen trigram wins, else the bigram estimate
                c_ab = self.next1[a][b]
                out[r] = [n2[x] / c_ab if x in n2 else n1.get(x, 0) / c_b for x in row]
            else:
                out[r] = [n1.get(x, 0) / c_b for x in row]
        return out


def read_trie(path: str | Path, vocab_size: int | None = None, cache: bool = True) -> NGram:
    """Read a released DART `.trie` file (layout in the module docstring) into an NGram.

    The file is mapped, not read into memory, and walked once in C++ (the engine's, `fast`; a Python loop where no
    compiler is found); the n-gram tables are then built with numpy and cached as .npz under DART_LAB_CACHE/ngram,
    keyed by the file (path, size, mtime) and the vocabulary, so the next load reads 12 bytes per n-gram.
    Memory at the first parse: ~53 bytes per node at the peak (16 kept per node while the tables are built, the
    rest the last level's keys and their sort), plus the mapped file's pages as they are read (clean page cache).
    For the paper's full.trie (1.3 B nodes, ~52 GB) that is ~70 GB once plus the file's pages, and ~16 GB of cached
    tables after (times: experiments/engine/trie_read.py); small.trie is what the released README suggests for a
    quick run."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise DartLabError(f"cannot read trie {path}: {e.strerror or e}") from None
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{vocab_size}".encode()).hexdigest()[:16]
    cached = cache_dir() / "ngram" / f"trie-{key}.npz"
    if cache and cached.is_file():
        try:
            return NGram.load(cached)
        except DartLabError:
            pass  # a damaged cache: parse again
    token, parent, freq, order = _trie_nodes(path)
    n = token.size
    if n == 0 or parent[0] != 0:
        raise DartLabError(f"{path}: node 0 is not a root; not a DART .trie file")
    # depth by parent links, level by level (a node deeper than the order, or on a cycle, stays -1)
    depth = np.full(n, -1, np.int8)
    depth[0] = 0
    for k in range(1, max(int(order), 3) + 1):
        depth[(depth < 0) & (depth[parent] == k - 1)] = k
    depth[0] = 0
    if (depth < 0).any():
        raise DartLabError(f"{path}: {int((depth < 0).sum())} nodes are not within {order} levels of the root; "
                           "not a DART .trie file")
    V = int(vocab_size or (token.max() + 1))
    if token[1:].size and (token[1:].min() < 0 or token[1:].max() >= V):
        raise DartLabError(f"{path}: token ids outside the vocabulary of {V}; a trie of another tokenizer?")
    Vi = np.int64(V)
    out = []
    for k in (1, 2, 3):
        sel = np.flatnonzero(depth == k)
        key_k = token[sel].astype(np.int64)
        up = sel
        for j in range(1, k):  # prepend the ancestors' tokens: (a*V + b)*V + t
            up = parent[up]
            key_k += token[up].astype(np.int64) * Vi ** j
        o = np.argsort(key_k, kind="stable")
        out.append((key_k[o], freq[sel][o].astype(np.uint32)))
        del sel, up, key_k, o
    ng = NGram(V, *out, meta={"source": path.name, "order": int(order), "nodes": int(n)})
    if cache:
        ng.save(cached)
    return ng


def _trie_nodes(path: Path) -> tuple:
    """(token int32, parent int64, freq int32, order) of every node, the file mapped read-only."""
    size = path.stat().st_size
    if size < 16:
        raise DartLabError(f"{path} is truncated ({size} bytes) or not a DART .trie file")
    buf = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: torch wants a writable array, nothing is written
    walked = fast.call("trie_nodes", buf, path)  # the engine's C++ walk, where it is built
    if walked is not None:
        return walked
    order, n = struct.unpack_from("<QQ", buf, 0)
    head = struct.Struct("<iQiQ")
    if n > (size - 16) // head.size:
        raise DartLabError(f"{path}: truncated: the header says {n} nodes, the file holds at most {(size - 16) // head.size}")
    token, parent, freq = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.int32)
    off = 16
    try:
        for i in range(n):
            token[i], parent[i], freq[i], nc = head.unpack_from(buf, off)
            off += head.size + 12 * nc  # children (int32 token, size_t id) are implied by parent links
    except struct.error:
        raise DartLabError(f"{path}: truncated at node {i} of {n}; not a complete DART .trie file") from None
    if off != size:
        raise DartLabError(f"{path}: {size - off} trailing bytes after {n} nodes; not a DART .trie file")
    if (parent[1:] >= n).any():
        raise DartLabError(f"{path}: a parent link outside the {n} nodes; not a DART .trie file")
    return token, parent, freq, order


def write_trie(path: str | Path, sequences, order: int = 3) -> None:
    """Write a `.trie` in the official layout (for tests and for exporting our counts).

    Every window seq[i:i+order] is inserted from the root, incrementing freq along its path."""
    token, parent, freq, children = [-1], [0], [0], [{}]
    for s in sequences:
        s = list(s)
        for i in range(len(s)):
            node = 0
            for t in s[i:i + order]:
                nxt = children[node].get(t)
                if nxt is None:
                    nxt = len(token)
                    token.append(t), parent.append(node), freq.append(0), children.append({})
                    children[node][t] = nxt
                node = nxt
                freq[node] += 1
    with open(path, "wb") as f:
        f.write(struct.pack("<QQ", order, len(token)))
        for i in range(len(token)):
            f.write(struct.pack("<iQiQ", token[i], parent[i], freq[i], len(children[i])))
            for t, c in children[i].items():
                f.write(struct.pack("<iQ", t, c))


# ----------------------------------------------------------------------------- corpus
def corpus_key(tokenizer_name: str, source: str, max_tokens: int) -> str:
    return hashlib.sha256(f"{tokenizer_name}|{source}|{max_tokens}".encode()).hexdigest()[:16]


def corpus_texts(source: str = "sharegpt"):
    """Texts of an n-gram corpus: 'sharegpt' (every turn of the packaged conversations) or
    'jsonl:PATH' (the 'text' field of each row)."""

    if source == "sharegpt":
        for rec in iter_sharegpt():
            for turn in rec["conversations"]:
                if turn["value"].strip():
                    yield turn["value"]
    elif source.startswith("jsonl:"):
        path = Path(source[len("jsonl:"):]).expanduser()
        if not path.is_file():
            raise DartLabError(f"n-gram corpus not found: {path}")
        for i, row in enumerate(_read_jsonl(path)):
            if not isinstance(row.get("text"), str):
                raise DartLabError(f"{path}: row {i + 1} has no 'text' string")
            yield row["text"]
    else:
        raise DartLabError(f"unknown n-gram corpus {source!r}: use 'sharegpt' or 'jsonl:PATH'")


def build_ngram(tokenizer, source: str = "sharegpt", max_tokens: int | None = None, cache: bool = True,
                batch: int = 2000, progress: bool = False) -> NGram:
    """Tokenise `source` with the target tokenizer and count 1/2/3-grams; cached under
    DART_LAB_CACHE/ngram keyed by tokenizer, source and max_tokens."""

    name = getattr(tokenizer, "name_or_path", "") + f"|{len(tokenizer)}"
    path = cache_dir() / "ngram" / f"{corpus_key(name, source, max_tokens or 0)}.npz"
    if cache and path.is_file():
        try:
            ng = NGram.load(path)
            ng.meta["tokenizer"] = Path(str(ng.meta.get("tokenizer", ""))).name
            return ng
        except DartLabError:
            pass  # corrupt cache: rebuild
    seqs, total, chunk = [], 0, []
    texts = corpus_texts(source)
    if progress:
        texts = tqdm(texts, desc="tokenising n-gram corpus", unit="text")

    def flush():
        nonlocal total
        for ids in tokenizer(chunk, add_special_tokens=False).input_ids:
            seqs.append(np.asarray(ids, dtype=np.int32))
            total += len(ids)
        chunk.clear()

    for t in texts:
        chunk.append(t)
        if len(chunk) >= batch:
            flush()
            if max_tokens and total >= max_tokens:
                break
    if chunk and not (max_tokens and total >= max_tokens):
        flush()
    if not seqs:
        raise DartLabError(f"n-gram corpus {source!r} is empty")
    tok_name = Path(str(getattr(tokenizer, "name_or_path", ""))).name  # a name, not this machine's path
    ng = NGram.from_sequences(seqs, len(tokenizer), meta={"source": source, "tokens": total, "tokenizer": tok_name})
    if cache:
        ng.save(path)
    return ng
