"""Our 4-bit kernel (`dart_lab.engine.q4`, csrc/q4mm.cpp) against torch's int4 CPU kernel (`Int4Linear`) and oneDNN
bf16 copies, on the embedded target's 120 decoder linears (the GGUF's Q4_1 groups) and its Q8_0 LM head (two
4-bit halves): ms of one sweep over all of them (every weight streamed from memory, as in a step) per row
count, median of 7 interleaved rounds; and each path's max error against bf16(x) W^T in fp32.
`--steps`: eager one-token steps of the 4-bit target after a 150-token prompt, in one process, alternating
torch's kernel at every width (`int4_paths` "4bit", LM head fp16) and the measured tables (ours where it won).

    python experiments/engine/q4_kernel.py [--rows 1,2,4,8,16,64] [--steps] [--avx2]
    python experiments/engine/q4_kernel.py --smoke [--steps]    # a tiny random Llama on 4-bit grids, seconds

`--avx2`: our kernel's AVX2 path (`q4.avx2_path`, what a CPU without AVX512-BF16 takes) as one more side.
main() returns {"30 layers' linears" | "LM head (Q8_0)": {"max_error": {side: ...}, "ms": {rows: {side: ms}}}}, or
with --steps {"one_token_step_ms": {"4bit" | "measured": ms}}; {} where our kernel is not built.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (run by path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab.engine import q4  # noqa: E402
from dart_lab.engine.int4 import Int4Linear, PackedLinear, int4_groups, int8_groups  # noqa: E402
from dart_lab.loading import INT4, load_target, make_target, use_dtype  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def grid_model():
    """The smallest mode's model: a tiny random Llama whose linears are 4-bit grids (its LM head an 8-bit one)."""
    model = tiny.tiny_model()
    tiny.as_4bit_grids(model)
    return model


def step_ab(rounds: int = 7, n: int = 30, smoke: bool = False) -> dict:
    if smoke:
        t = make_target(grid_model(), name="tiny-llama-q4", runner="fast")
        use_dtype(t, INT4)
    else:
        t = load_target(dtype="int4")
    prompt = torch.randint(3, min(t.vocab_size, 20000), (30 if smoke else 150,), generator=torch.Generator().manual_seed(0))
    P = prompt.numel()

    @torch.no_grad()
    def steps(mode: str) -> float:
        t.int4_paths = mode
        t.prefill(prompt)
        tok = 5
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(t.verify(Tree.single(tok)).logits[0].argmax())
            t.commit([0])
            t.truncate(P)
        return (time.perf_counter() - t0) / n * 1e3

    modes = {"4bit": "torch's kernel", "measured": "measured tables (ours)"}
    got = {m: [] for m in modes}
    for m in modes:
        steps(m)
    for _ in range(rounds):
        for m in modes:
            got[m].append(steps(m))
    paths = t.dtype_report["int4"]["by_rows"]
    print("measured tables: " + "; ".join(f"{k} {paths[k]['paths']}" for k in ("qkv", "o", "gate_up", "down", "lm_head")))
    for m, label in modes.items():
        print(f"one-token step, {label}: {statistics.median(got[m]):.2f} ms (rounds {min(got[m]):.2f}-{max(got[m]):.2f})")
    return {"one_token_step_ms": {m: statistics.median(got[m]) for m in modes}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--steps", action="store_true", help="one-token steps, torch's kernel against the tables")
    ap.add_argument("--avx2", action="store_true", help="our kernel's AVX2 path as one more side")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random Llama on 4-bit grids, rows 1,4, 3 rounds (the tests' mode)")
    args = ap.parse_args(argv)
    if not q4.available():
        print(f"our kernel is not available here: {q4.reason()}")
        return {}
    if not args.smoke:
        torch.set_num_threads(2)
    if args.steps:
        return step_ab(2, 5, smoke=True) if args.smoke else step_ab()
    if args.smoke:
        args.rows = "1,4"
    model = grid_model() if args.smoke else load_target(dtype="fp32", runner="fast").model
    def bf16_copy(w):
        """oneDNN's packed bf16 copy, None on a CPU that cannot pack bf16 (it needs AVX-512 or AVX-NE-CONVERT)."""
        try:
            return PackedLinear(SimpleNamespace(weight=w.to(torch.bfloat16), bias=None))
        except RuntimeError:
            return None

    layers = []  # (weight, torch int4, ours, bf16 copy)
    for l in model.model.layers:
        for mods in ((l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj), (l.self_attn.o_proj,),
                     (l.mlp.gate_proj, l.mlp.up_proj), (l.mlp.down_proj,)):
            w = torch.cat([m.weight.detach() for m in mods])
            g = int4_groups(w)
            layers.append((w, Int4Linear(*g), q4.Q4Linear.of_groups(g),
                           bf16_copy(w)))
    hw = model.lm_head.weight.detach()
    g8 = int8_groups(hw)
    head = (hw, Int4Linear.of_8bit(model.lm_head, groups=g8),
            q4.Q4Linear.of_groups(Int4Linear.halves_of(*g8), halves=2),
            bf16_copy(hw))
    packs = all(lin[3] is not None for lin in layers + [head])
    names = ("torch int4", "ours") + (("ours AVX2",) if args.avx2 else ()) + (("bf16",) if packs else ())
    avx2 = q4.avx2_path()

    def call(lin, i, x):  # lin: (the weight, torch int4, ours, bf16 copy)
        n = names[i]
        if n == "ours AVX2":
            q4.avx2_path(True)
            try:
                return lin[2](x)
            finally:
                q4.avx2_path(avx2)
        return lin[3](x.to(torch.bfloat16)).float() if n == "bf16" else lin[1 if n == "torch int4" else 2](x)

    g = torch.Generator().manual_seed(0)
    out = {}
    for what, lins in (("30 layers' linears" if not args.smoke else "the layers' linears", layers),
                       ("LM head (Q8_0)", [head])):
        x1 = {n: torch.randn(3, n, generator=g) for n in {lin[0].shape[1] for lin in lins}}
        def err(lin, i):
            x = x1[lin[0].shape[1]]
            return float((call(lin, i, x) - x.to(torch.bfloat16).float() @ lin[0].T).abs().max())

        errs = {n: max(err(lin, i) for lin in lins) for i, n in enumerate(names)}
        out[what] = {"max_error": errs, "ms": {}}
        print(f"\n{what}: max |y - bf16(x) W^T| " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
        print("| rows | " + " | ".join(f"{n} ms" for n in names) + " | ours / torch int4 |\n" + "|---" * (len(names) + 2) + "|")
        for r in (int(v) for v in args.rows.split(",")):
            xs = {n: torch.randn(r, n, generator=g) for n in x1}
            got = {n: [] for n in names}
            for rnd in range(4 if args.smoke else 8):
                for i, n in enumerate(names):
                    t0 = time.perf_counter()
                    for lin in lins:
                        call(lin, i, xs[lin[0].shape[1]])
                    if rnd:
                        got[n].append((time.perf_counter() - t0) * 1e3)
            med = {n: statistics.median(v) for n, v in got.items()}
            out[what]["ms"][r] = med
            print(f"| {r} | " + " | ".join(f"{med[n]:.2f}" for n in names) + f" | {med['ours'] / med['torch int4']:.2f} |",
                  flush=True)
    return out


if __name__ == "__main__":
    main()
