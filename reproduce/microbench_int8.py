"""Would int8 weight-only matmuls make the draft head cheaper on this CPU? Times one linear of each of
the head's shapes (SmolLM2-135M: hidden 576, MLP 1536, draft vocabulary 8,192) at the row counts a
decode step uses, in bf16, fp32 and int8 weights with bf16 activations (`_weight_int8pack_mm`, the
kernel torch uses for CPU weight-only int8), same process, random weights. Run it on an idle machine.

    python reproduce/microbench_int8.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def bench(f, n: int = 300) -> float:
    for _ in range(20):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    torch.manual_seed(0)
    shapes = {"lm_head (8192 x 576)": (8192, 576), "gate / up (1536 x 576)": (1536, 576),
              "down (576 x 1536)": (576, 1536), "q / o (576 x 576)": (576, 576), "fc (576 x 1728)": (576, 1728)}
    print("shape, rows: bf16 / fp32 / int8-weight ms (max abs error of int8 vs bf16 weights)")
    for name, (n, k) in shapes.items():
        for m in (9, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
            scales = (w.float().abs().amax(1) / 127).to(torch.bfloat16)
            wq = torch.round(w.float() / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
            xf, wf = x.float(), w.float()
            t_bf16 = bench(lambda: F.linear(x, w))
            t_fp32 = bench(lambda: F.linear(xf, wf))
            t_int8 = bench(lambda: torch.ops.aten._weight_int8pack_mm(x, wq, scales))
            err = (torch.ops.aten._weight_int8pack_mm(x, wq, scales).float() - xf @ wf.T).abs().max().item()
            print(f"{name}, {m}: {t_bf16:.3f} / {t_fp32:.3f} / {t_int8:.3f} ms ({err:.3f})")


if __name__ == "__main__":
    with torch.no_grad():
        main()
