"""Would a prompt's linears run faster as int8 products through torch's dynamic quantized Linear (fbgemm /
oneDNN: x rounded to int8 per call, weights per channel) than as the bf16 matmul the prefill uses? One
prompt-sized matmul (M rows) per shape of SmolLM2-135M's linears, median ms and products per second.

    python experiments/engine/prefill_int8_dynamic.py [--rows 1024] [--calls 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, x, calls: int) -> float:
    for _ in range(3):
        fn(x)
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(x)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print("| K x N | bf16 ms (GMAC/s) | int8 dynamic ms (GMAC/s) | fp32 ms |\n|---|---|---|---|")
    for K, N in ((576, 960), (576, 576), (576, 3072), (1536, 576)):
        lin = torch.nn.Linear(K, N, bias=False)
        x = torch.randn(args.rows, K)
        w = lin.weight.detach()
        dq = torch.ao.nn.quantized.dynamic.Linear(K, N, bias_=False, dtype=torch.qint8)
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127
        dq.set_weight_bias(torch.quantize_per_channel(w, scales, torch.zeros(N, dtype=torch.long), 0, torch.qint8), None)
        wb, xb = w.bfloat16(), x.bfloat16()
        ms = {"bf16": timed(lambda v: torch.nn.functional.linear(v, wb), xb, args.calls),
              "int8": timed(dq, x, args.calls), "fp32": timed(lin, x, args.calls)}
        g = lambda m: args.rows * K * N / m / 1e6  # noqa: E731
        print(f"| {K} x {N} | {ms['bf16']:.2f} ({g(ms['bf16']):.0f}) | {ms['int8']:.2f} ({g(ms['int8']):.0f}) | "
              f"{ms['fp32']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
