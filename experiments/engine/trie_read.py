"""How fast is the released n-gram trie read (`ngram.read_trie`: the C++ walk, numpy tables, the .npz cache),
against the Python loop it replaces, and how much memory does the first parse take?

A synthetic order-3 trie in the released binary layout (root -> A tokens -> B children each -> C children
each: 1 + A + A*B + A*B*C nodes, written with numpy), each reading in its own process (peak RSS per process).

    python experiments/engine/trie_read.py                 # 20 M nodes (~0.8 GB file)
    python experiments/engine/trie_read.py --shape 100,100,100
    python experiments/engine/trie_read.py --smoke         # ~1,000-node tries, every reading in this process

Prints one JSON line per reading; main() returns them as a list.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (run by path)
from dart_lab.smoke import SMOKE  # noqa: E402


def write_synthetic(path: Path, A: int, B: int, C: int, V: int = 151936, seed: int = 0) -> int:
    """The released layout, level by level (nodes numbered breadth first: each parent before its children)."""
    rng = np.random.default_rng(seed)

    def level(n: int, parents: np.ndarray, k: int, first_child: int) -> bytes:
        ch = np.dtype([("t", "<i4"), ("id", "<u8")])
        rec = np.dtype([("tok", "<i4"), ("par", "<u8"), ("freq", "<i4"), ("nc", "<u8")] + ([("ch", ch, (k,))] if k else []))
        r = np.zeros(n, rec)
        r["tok"] = rng.integers(0, V, n) if n > 1 else -1
        r["par"], r["freq"], r["nc"] = parents, rng.integers(1, 1000, n), k
        if k:
            r["ch"]["id"] = first_child + np.arange(n * k).reshape(n, k)
            r["ch"]["t"] = rng.integers(0, V, (n, k))
        return r.tobytes()

    n1, n2, n3 = A, A * B, A * B * C
    with open(path, "wb") as f:
        f.write(np.array([3, 1 + n1 + n2 + n3], "<u8").tobytes())
        f.write(level(1, np.zeros(1, np.uint64), A, 1))
        f.write(level(n1, np.zeros(n1, np.uint64), B, 1 + n1))
        f.write(level(n2, np.repeat(np.arange(1, 1 + n1, dtype=np.uint64), B), C, 1 + n1 + n2))
        for s in range(0, n3, 1 << 22):  # the leaves in chunks
            m = min(1 << 22, n3 - s)
            f.write(level(m, (1 + n1 + (s + np.arange(m)) // C).astype(np.uint64), 0, 0))
    return 1 + n1 + n2 + n3


def one(mode: str, path: str, digits: int = 2) -> dict:
    from dart_lab.engine import kernels
    from dart_lab.ngram import read_trie

    t0 = time.perf_counter()
    if mode == "python":
        with kernels.turned_off("trie"):
            ng = read_trie(path, vocab_size=151936, cache=False)
    else:
        kernels.trie_here()  # the build (cached by torch) outside the timing
        t0 = time.perf_counter()
        ng = read_trie(path, vocab_size=151936, cache=mode != "cpp")
    return {"mode": mode, "s": round(time.perf_counter() - t0, digits), "peak_rss_gb": round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2), **ng.num_ngrams}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1000,100,200", help="A,B,C: tokens, children, grandchildren")
    ap.add_argument("--python-shape", default="100,100,100", help="the Python loop's (smaller) trie")
    ap.add_argument("--in-process", action="store_true", help="every reading in this process (peak RSS: this one's)")
    ap.add_argument("--smoke", action="store_true", default=SMOKE,
                    help="shapes 20,10,5 and 10,5,5, in process (the tests' mode)")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(*a.one)))
        return []
    if a.smoke:
        a.shape, a.python_shape, a.in_process = "20,10,5", "10,5,5", True
    out = []
    saved = os.environ.get("DART_LAB_CACHE")
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "DART_LAB_CACHE": str(Path(d) / "cache")}
        for shape, modes in ((a.shape, ("cpp", "cache-write", "cache-read")), (a.python_shape, ("cpp", "python"))):
            path = Path(d) / f"t{shape}.trie"
            nodes = write_synthetic(path, *map(int, shape.split(",")))
            for mode in modes:
                if a.in_process:
                    os.environ["DART_LAB_CACHE"] = env["DART_LAB_CACHE"]  # the .npz cache in the temporary folder
                    try:
                        got = one(mode, str(path), digits=5)
                    finally:
                        if saved is None:
                            del os.environ["DART_LAB_CACHE"]
                        else:
                            os.environ["DART_LAB_CACHE"] = saved
                else:
                    got = json.loads(subprocess.run([sys.executable, __file__, "--one", mode, str(path)], env=env,
                                                    capture_output=True, text=True, check=True).stdout)
                row = {"nodes": nodes, "file_gb": round(path.stat().st_size / 1e9, 6 if a.smoke else 3), **got}
                row["nodes_per_s_m"] = round(nodes / max(row["s"], 1e-6) / 1e6, 1)
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


if __name__ == "__main__":
    main()
