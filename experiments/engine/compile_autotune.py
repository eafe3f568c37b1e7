"""Does inductor's max-autotune (its C++ WOQ int4 GEMM template, autotuned against the ATen int4 kernel per
shape) make a compiled 4-bit step cheaper than the default compile? One-token and 4-node verifies of the
embedded target after a 200-token prompt, three rounds of 40 steps each, medians. Run once per mode (each in
its own process: inductor's config is read when a shape compiles).

    python experiments/engine/compile_autotune.py default
    python experiments/engine/compile_autotune.py autotune
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def run(mode: str) -> None:
    target = load_target("smollm2-135m", dtype="int4", compile=True)
    target.node_buckets = (1, 4)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    target.precompile(320)
    print(mode, "compile s", round(time.perf_counter() - t0, 1), flush=True)
    res: dict = {}
    for _ in range(3):
        for nb in (1, 4):
            target.reset()
            target.prefill(torch.randint(3, 1000, (200,), generator=g))
            ts = []
            for _ in range(40):
                tree = Tree(torch.randint(3, 1000, (nb,), generator=g), torch.arange(-1, nb - 1))
                t1 = time.perf_counter()
                target.verify(tree)
                target.commit([0])
                ts.append((time.perf_counter() - t1) * 1e3)
            res.setdefault(nb, []).append(round(statistics.median(ts), 2))
    print(mode, "step ms by nodes (three rounds)", res, flush=True)


def main(argv=None) -> int:
    mode = (argv or sys.argv[1:] or ["default"])[0]
    if mode == "autotune":
        with torch._inductor.config.patch(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"):
            run(mode)
    else:
        run(mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
