"""The LM head's paths per row count on this CPU: which one the 4-bit target should take where
(`fast_llama.int4_projections`: 16-bit for one row, the 8-bit grid as two 4-bit halves for 2+ rows).

Times one call of the embedded target's head (49152 x 576) in fp32, bf16, fp16, as two 4-bit halves
(`Int4Linear.of_8bit`: torch's int4 kernel; `q4 halves`: ours) and as the 8-bit grid itself (`q8`: our
`q8mm`), for 1..32 rows, the variants interleaved call by call (median of `--calls`), and
each one's largest logit error against fp32 on the same inputs.

    .venv/bin/python experiments/engine/head_paths.py [--rows 1,2,4,8,16,32] [--calls 40]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from dart_lab import load_target, q4
from dart_lab.fast_llama import Int4Linear, int8_groups


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    torch.manual_seed(0)
    head = load_target(args.model, dtype="fp32").model.lm_head
    w = head.weight.detach()
    variants = {"fp32": lambda x: F.linear(x, w)}
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        wd = w.to(dt)
        variants[name] = lambda x, wd=wd, dt=dt: F.linear(x.to(dt), wd).float()
    grid = int8_groups(w, Int4Linear.group)
    if grid is not None:
        halves = Int4Linear.of_8bit(head, groups=grid)
        variants["int8 halves"] = lambda x: halves(x).float()
        ours = q4.Q4Linear.of_groups(Int4Linear.halves_of(*grid), halves=2)
        q8 = q4.Q8Linear.of_grid(*grid)
        if ours is not None and q8 is not None:
            variants["q4 halves"], variants["q8"] = ours, q8
    out = {}
    with torch.no_grad():
        for n in map(int, args.rows.split(",")):
            x = torch.randn(n, w.shape[1])
            x = x / x.norm(dim=-1, keepdim=True) * w.shape[1] ** 0.5  # an RMS-normed input
            ref = variants["fp32"](x)
            times = {k: [] for k in variants}
            for _ in range(3):  # warm-up
                for f in variants.values():
                    f(x)
            for _ in range(args.calls):
                for k, f in variants.items():
                    t0 = time.perf_counter()
                    f(x)
                    times[k].append((time.perf_counter() - t0) * 1e3)
            out[n] = {k: {"ms": round(statistics.median(v), 2),
                          "max_err": round(float((variants[k](x) - ref).abs().max()), 4)} for k, v in times.items()}
            print(json.dumps({"rows": n, **out[n]}), flush=True)


if __name__ == "__main__":
    main()
