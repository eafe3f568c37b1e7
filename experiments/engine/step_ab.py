"""A change to the layer math (`fast_llama.decoder_step`) timed against another revision's, in one process:
the two functions alternate run by run on the same target (eager one-token steps after a random prompt; with
`--rows B`, B rows' one-token steps together through `BatchTarget`, prompts of 0.67-1.33x the context), so a
slow stretch of the machine hits both; median ms per step and whether both emitted the same tokens.

    python experiments/engine/step_ab.py --rev HEAD~1 [--dtype int4] [--runs 10] [--steps 40] [--rows 8]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from dart_lab import fast_llama  # noqa: E402
from dart_lab.batch import BatchTarget  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def decoder_step_at(rev: str | None):
    """`decoder_step` as the file stood at git revision `rev` (None: the working tree's file), loaded as a module
    of its own -- both sides alike: the live module's function read ~4 % slower than an identical copy."""
    src = (ROOT / "dart_lab/fast_llama.py").read_text() if rev is None else subprocess.run(
        ["git", "show", f"{rev}:dart_lab/fast_llama.py"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "fast_llama_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"dart_lab.fast_llama_{'tree' if rev is None else 'rev'}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look themselves up there
    spec.loader.exec_module(mod)
    return mod.decoder_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True, help="the git revision to compare the working tree against")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args(argv)
    fns = {args.rev: decoder_step_at(args.rev), "working tree": decoder_step_at(None)}
    t = load_target("smollm2-135m", dtype=args.dtype)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (args.context,), generator=g)
    lens = torch.randint(args.context * 2 // 3, args.context * 4 // 3, (args.rows,), generator=g)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g) for n in lens]
    bt = BatchTarget(t)

    def steps() -> tuple[list[int], float]:
        """A prompt (or B), then the steps: the tokens and the steps' seconds."""
        if args.rows == 1:
            t.prefill(prompt)
            tok, out, t0 = 500, [], time.perf_counter()
            for _ in range(args.steps):
                tok = int(t.verify(Tree.single(tok)).logits[0].argmax())
                out.append(tok)
                t.commit([0])
            return out, time.perf_counter() - t0
        bt.prefill(prompts)
        toks, out, t0 = [500] * args.rows, [], time.perf_counter()
        for _ in range(args.steps):
            toks = bt.verify([Tree.single(x) for x in toks]).flat.max(-1).indices.tolist()
            out += toks
            bt.commit([[0]] * args.rows)
        return out, time.perf_counter() - t0

    ms, tokens = {k: [] for k in fns}, {}
    for r in range(args.runs + 2):  # runs 0-1 warm up
        for name in (list(fns) if r % 2 else list(reversed(fns))):
            fast_llama.decoder_step = fns[name]  # FastTarget looks it up in the module at every step
            out, s = steps()
            if r >= 2:
                ms[name].append(s / args.steps * 1e3)
            tokens.setdefault(name, out)
    a, b = fns
    print(json.dumps({"dtype": args.dtype, "rows": args.rows, "step_ms": {k: round(statistics.median(v), 2) for k, v in ms.items()},
                      "same_tokens": tokens[a] == tokens[b]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
