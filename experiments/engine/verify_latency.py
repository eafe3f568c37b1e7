"""Target verify latency vs tree size, per dtype and committed context, on this machine (the cost side of
speculation; a node's attention reads every cached token, so the curve steepens with the context).

    .venv/bin/python experiments/engine/verify_latency.py [--dtypes fp32,bf16] [--repeats 7] [--contexts 128,600,1200]
    .venv/bin/python experiments/engine/verify_latency.py --smoke     # a tiny random Llama, a few seconds

Prints one JSON line per dtype@context: {nodes: median ms of one verify}; main() returns them all.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab import load_target  # noqa: E402
from dart_lab.loading import use_dtype  # noqa: E402
from dart_lab.measure import measure_verify  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32, 48, 64)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--contexts", default="128", help="committed tokens before the timed verify, comma-separated")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random Llama, sizes 1-8, 2 repeats (the tests' mode)")
    args = ap.parse_args(argv)
    sizes, repeats = ((1, 2, 4, 8), 2) if args.smoke else (SIZES, args.repeats)
    out = {}
    for dt in args.dtypes.split(","):
        if args.smoke:
            t = tiny.tiny_target()
            use_dtype(t, DTYPES[dt])
        else:
            t = load_target(args.model, dtype=dt)
        for ctx in map(int, args.contexts.split(",")):
            out[f"{dt}@{ctx}"] = {n: round(ms, 3 if args.smoke else 1)
                                  for n, ms in measure_verify(t, sizes, repeats, ctx).items()}
            print(json.dumps({f"{dt}@{ctx}": out[f"{dt}@{ctx}"]}), flush=True)
    return out


if __name__ == "__main__":
    main()
