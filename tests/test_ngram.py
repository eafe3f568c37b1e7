"""N-gram counts against brute force, back-off, persistence and the official .trie layout."""
import struct
from collections import Counter

import numpy as np
import pytest

from dart_lab import DartLabError
from dart_lab.ngram import LocalNGram, NGram, read_trie, write_trie


def brute(seqs):
    c3 = Counter(tuple(s[i:i + 3]) for s in seqs for i in range(len(s) - 2))
    c2 = Counter(tuple(s[i:i + 2]) for s in seqs for i in range(len(s) - 1))
    c1 = Counter(t for s in seqs for t in s)
    return c1, c2, c3


def test_counts_and_backoff_match_brute_force(tmp_path):
    rng = np.random.default_rng(0)
    V = 30
    seqs = [rng.integers(0, V, size=rng.integers(1, 50)).tolist() for _ in range(60)]
    ng = NGram.from_sequences(seqs, V)
    c1, c2, c3 = brute(seqs)
    assert dict(zip(ng.tri_keys.tolist(), ng.tri_counts.tolist())) == {(a * V + b) * V + c: n for (a, b, c), n in c3.items()}
    ctx = rng.integers(-1, V, size=(200, 2))
    ctx[:, 1] = np.abs(ctx[:, 1])
    toks = rng.integers(0, V, size=(200, 5))
    got = ng.prob(ctx, toks)
    for r in range(200):
        a, b = int(ctx[r, 0]), int(ctx[r, 1])
        for k in range(5):
            t = int(toks[r, k])
            if a >= 0 and c3[(a, b, t)] > 0:  # per-token back-off (released TrieNgram)
                want = c3[(a, b, t)] / c2[(a, b)]
            elif c2[(b, t)] > 0:
                want = c2[(b, t)] / c1[b]
            else:
                want = 0.0
            assert got[r, k] == pytest.approx(want)
    ng2 = NGram.load(ng.save(tmp_path / "t.npz"))
    assert np.array_equal(ng2.prob(ctx, toks), got)


def test_local_ngram_grown_in_place_equals_a_rebuilt_table():
    """dart-ctx's request-local n-gram, extended a few tokens at a time, gives exactly the probabilities
    of an NGram rebuilt from the whole sequence at every stage (contexts with -1, unseen tokens)."""
    rng = np.random.default_rng(1)
    V = 12  # small: many repeated bigrams and trigrams
    seq = rng.integers(0, V, size=5).tolist()
    local = LocalNGram(seq)
    for _ in range(30):
        seq += rng.integers(0, V, size=int(rng.integers(1, 5))).tolist()
        local.sync(seq)
        ctx = rng.integers(-1, V, size=(20, 2))
        toks = rng.integers(0, V + 3, size=(20, 7))  # ids the sequence never holds too
        assert np.array_equal(local.prob(ctx, toks), NGram.from_sequences([seq], V + 3).prob(ctx, toks))
    assert local.seq == seq


def test_official_trie_layout(tmp_path):
    """A tiny trie written byte by byte in the documented layout: sequence [5, 6, 7] inserted as
    windows [5,6,7], [6,7], [7] (order 3)."""
    nodes = [  # token, parent, freq, children [(token, id)]
        (-1, 0, 0, [(5, 1), (6, 4), (7, 6)]),
        (5, 0, 1, [(6, 2)]), (6, 1, 1, [(7, 3)]), (7, 2, 1, []),
        (6, 0, 1, [(7, 5)]), (7, 4, 1, []),
        (7, 0, 1, []),
    ]
    buf = struct.pack("<QQ", 3, len(nodes))
    for tok, par, freq, ch in nodes:
        buf += struct.pack("<i", tok) + struct.pack("<Q", par) + struct.pack("<i", freq) + struct.pack("<Q", len(ch))
        for t, i in ch:
            buf += struct.pack("<i", t) + struct.pack("<Q", i)
    path = tmp_path / "tiny.trie"
    path.write_bytes(buf)
    ng = read_trie(path, vocab_size=10)
    ref = NGram.from_sequences([[5, 6, 7]], 10)
    for name in ("uni", "bi", "tri"):
        assert np.array_equal(getattr(ng, name + "_keys"), getattr(ref, name + "_keys"))
        assert np.array_equal(getattr(ng, name + "_counts"), getattr(ref, name + "_counts"))
    assert ng.prob(np.array([[5, 6]]), np.array([[7, 6]])).tolist() == [[1.0, 0.0]]
    # our writer produces the same layout
    write_trie(tmp_path / "ours.trie", [[5, 6, 7]])
    assert NGram.load(tmp_path / "ours.trie", vocab_size=10).tri_keys.tolist() == ng.tri_keys.tolist()
    (tmp_path / "bad.trie").write_bytes(buf[:-5])
    with pytest.raises(DartLabError, match="truncated"):
        read_trie(tmp_path / "bad.trie")
