"""Is a prompt's prefill cheaper than at another git revision? The revision is checked out in a temporary git
worktree; each side runs in its own process (its own kernels' build, its own cached path tables), the two
alternating for `--rounds` rounds. Each process loads the embedded target (`--dtype`, int4 by default) and
times, median of 5 after 2 warm-ups: the first 8 HumanEval prompts packed in one forward (`BatchTarget`, as a
batch of 8 starts), the next 8, and the first 4 alone (`Target.prefill`, as one sequence starts).

    python experiments/engine/prefill_rev_ab.py --rev <before> [--rounds 3] [--dtype int4]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SIDE = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from dart_lab.batch import BatchTarget
from dart_lab.data import load_prompts
from dart_lab.loading import load_target

t = load_target("smollm2-135m", dtype=sys.argv[2])
prompts = [t.encode_prompt(p["prompt"]) for p in load_prompts("humaneval", 16)]
bt = BatchTarget(t)


def med(f, n=5, warm=2):
    for _ in range(warm):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(ts), 1)


def alone(p):
    t.reset()
    t.prefill(p)


print(json.dumps({"packed 1-8": med(lambda: bt.prefill(prompts[:8])), "packed 9-16": med(lambda: bt.prefill(prompts[8:])),
                  "alone 1-4": [med(lambda: alone(p), 3, 1) for p in prompts[:4]]}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="int4")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "rev"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), args.rev], cwd=ROOT, check=True)
        try:
            sides = {args.rev: old, "now": ROOT}
            for r in range(args.rounds):
                for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    # each side's kernels built apart (one build per source)
                    env = {"TORCH_EXTENSIONS_DIR": str(Path(tmp) / f"ext_{name}")}
                    out = subprocess.run([sys.executable, "-c", SIDE, str(sides[name]), args.dtype], check=True,
                                         capture_output=True, text=True, env={**os.environ, **env})
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                    print(f"round {r} {name:>10}: " + "; ".join(f"{k} {v} ms" for k, v in row.items()), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
