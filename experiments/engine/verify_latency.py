"""Target verify latency vs tree size, per dtype and committed context, on this machine (the cost side of
speculation; a node's attention reads every cached token, so the curve steepens with the context).

    .venv/bin/python experiments/engine/verify_latency.py [--dtypes fp32,bf16] [--repeats 7] [--contexts 128,600,1200]
"""
import argparse
import json

from dart_lab import load_target
from dart_lab.budget import measure_verify as verify_latency


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--contexts", default="128", help="committed tokens before the timed verify, comma-separated")
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    out = {}
    for dt in args.dtypes.split(","):
        t = load_target(args.model, dtype=dt)
        for ctx in map(int, args.contexts.split(",")):
            out[f"{dt}@{ctx}"] = {n: round(ms, 1) for n, ms in
                                  verify_latency(t, (1, 2, 4, 8, 16, 32, 48, 64), args.repeats, ctx).items()}
            print(json.dumps({f"{dt}@{ctx}": out[f"{dt}@{ctx}"]}), flush=True)


if __name__ == "__main__":
    main()
