"""Where a GPU step's time goes: the wall ms of one verify against the GPU's busy time in it (the CUDA
kernels' own time, torch.profiler) and the number of kernel launches, per batch size and tree size, for
gpu_check.py's random-weight Qwen3-4B-shaped target (bf16, the fast runner, eager). A wall far above
the busy time means the step waits on Python launching kernels one by one, not on the GPU.

    python experiments/engine/gpu_launch_bound.py [--out launch.json] [--toy --device cpu]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dart_lab import Tree  # noqa: E402
from dart_lab.batch import BatchTarget  # noqa: E402
from dart_lab.loading import make_target, resolve_device  # noqa: E402
from dart_lab.target import sync  # noqa: E402
from gpu_check import QWEN3_4B, TOY  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    dev = resolve_device(args.device)
    shape = TOY if args.toy else QWEN3_4B
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(torch.bfloat16).eval()
    target = make_target(model, runner="fast")
    prompt_len = 64 if args.toy else 512
    grid = [(1, 1), (1, 61), (8, 1), (16, 1), (16, 61), (32, 1), (64, 1), (64, 61)]
    out = []
    g = torch.Generator().manual_seed(0)
    for B, N in grid:
        bt = BatchTarget(target)
        bt.prefill([torch.randint(3, 1000, (prompt_len,), generator=g) for _ in range(B)])

        def step():
            bt.verify([Tree(torch.randint(3, 1000, (N,), generator=g), torch.arange(-1, N - 1)) for _ in range(B)])
            bt.commit([[0]] * B)
            bt.truncate(prompt_len)

        for _ in range(3):
            step()
        walls = []
        for _ in range(10):
            sync(dev)
            t0 = time.perf_counter()
            step()
            sync(dev)
            walls.append((time.perf_counter() - t0) * 1e3)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(5):
                step()
            sync(dev)
        ev = prof.key_averages()
        busy = sum(e.self_device_time_total for e in ev) / 1e3 / 5
        launches = sum(e.count for e in ev if "LaunchKernel" in e.key) / 5
        ops = sum(e.count for e in ev if e.key.startswith("aten::")) / 5
        row = {"batch": B, "nodes": N, "wall_ms": round(statistics.median(walls), 2), "gpu_busy_ms": round(busy, 2),
               "kernel_launches": launches, "aten_ops": ops}
        out.append(row)
        print(json.dumps(row), flush=True)
        del bt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": str(dev), "torch": torch.__version__, "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
