"""How long a prompt's prefill takes on the 4-bit target when its linears take the path measured fastest
for the prompt's row count (`FastTarget.int4_paths` "measured": bf16 copies on a CPU with bf16 units)
against the dense fp32 weights ("4bit", whose prompts run dense). Random prompts, lengths interleaved.

    python experiments/engine/prefill_paths.py [--lengths 40,160,320] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.loading import load_target  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="40,160,320")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    target = load_target("smollm2-135m", dtype="int4")
    target._int4()  # the per-row tables (measured once per machine, then cached)
    print(json.dumps({"tables": target.dtype_report["int4"]["by_rows"]["tables"]}), flush=True)
    g = torch.Generator().manual_seed(0)
    for n in (int(x) for x in args.lengths.split(",")):
        prompt = torch.randint(3, target.vocab_size, (n,), generator=g)
        times = {"measured": [], "4bit": []}
        for r in range(args.repeats + 1):
            for mode in times:
                target.int4_paths = mode
                target.reset()
                t0 = time.perf_counter()
                target.prefill(prompt)
                if r:  # round 0 warms up
                    times[mode].append((time.perf_counter() - t0) * 1e3)
        row = {k: round(statistics.median(v), 1) for k, v in times.items()}
        print(json.dumps({"prompt_tokens": n, "prefill_ms": row,
                          "speedup": round(row["4bit"] / row["measured"], 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
