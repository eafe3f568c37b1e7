"""Command line: `dart-lab generate ...` (also `python -m dart_lab`).

Errors a user can cause are printed as one line on stderr with a non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys

from .errors import DartLabError

from .methods import METHODS


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="embedded name or HF id/path of the target")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dart-head", default="", help="DART head folder (default: shipped head for the target)")
    p.add_argument("--eagle3-head", default="", help="EAGLE-3 head folder (default: shipped head)")
    p.add_argument("--ngram", default="sharegpt", help="sharegpt | jsonl:PATH | FILE.npz | FILE.trie")
    p.add_argument("--ngram-max-tokens", type=int, default=0)
    p.add_argument("--sps-model", default="", help="smaller draft LM for sps (HF id or path)")
    p.add_argument("--random-heads", action="store_true", help="untrained heads (plumbing checks only)")
    p.add_argument("--tree-nodes", type=int, default=0, help="draft tree size (0 = method default, 60)")


def _options(args):
    from .methods import MethodOptions

    return MethodOptions(dart_head=args.dart_head, eagle3_head=args.eagle3_head, ngram=args.ngram,
                         ngram_max_tokens=args.ngram_max_tokens, sps_model=args.sps_model,
                         random_heads=args.random_heads, tree_nodes=args.tree_nodes)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dart-lab", description="DART speculative decoding lab")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from one prompt")
    g.add_argument("--method", default="ar", help="one of: " + ", ".join(METHODS))
    g.add_argument("--prompt", required=True)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    _add_generation_args(g)
    b = sub.add_parser("bench", help="benchmark methods on a dataset (one JSON)")
    b.add_argument("--methods", default="ar,dart", help="comma list of: " + ", ".join(METHODS))
    b.add_argument("--dataset", default="mt_bench", help="mt_bench | humaneval | gsm8k | code_alpaca | alpaca | jsonl:PATH")
    b.add_argument("--num-prompts", type=int, default=10)
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--out", required=True, help="output JSON file")
    b.add_argument("--no-progress", action="store_true")
    _add_generation_args(b)
    return ap


def cmd_generate(args) -> int:
    from .config import GenerationConfig
    from .generate import generate, hf_generate
    from .target import load_target

    from .methods import make_drafter

    if args.method not in METHODS:
        raise DartLabError(f"unknown method {args.method!r}; choose from {', '.join(METHODS)}")
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed)
    if not args.prompt.strip():
        raise DartLabError("prompt is empty")
    target = load_target(args.model, device=args.device, dtype=args.dtype)
    ids = target.encode_prompt(args.prompt, chat=not args.no_chat_template)
    if args.method in ("hf", "hf-pld"):
        res = hf_generate(target, ids, cfg, prompt_lookup_num_tokens=10 if args.method == "hf-pld" else None)
    else:
        res = generate(target, ids, make_drafter(args.method, target, _options(args)), cfg)
    if args.json:
        print(json.dumps({"text": res.text, "new_tokens": res.new_tokens, "tokens_per_s": round(res.tokens_per_s, 3),
                          "tau": res.tau, "prefill_s": res.prefill_s, "decode_s": res.decode_s,
                          "stop_reason": res.stop_reason, "method": res.method, "model": args.model,
                          "dtype": str(target.dtype), "device": str(target.device), "config": res.config}))
    else:
        print(res.text)
    return 0


def cmd_bench(args) -> int:
    from .bench import BenchConfig, run_bench

    cfg = BenchConfig(methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()), dataset=args.dataset,
                      num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, top_k=args.top_k, seed=args.seed, warmup=args.warmup, model=args.model,
                      device=args.device, dtype=args.dtype, options=_options(args))
    res = run_bench(cfg, args.out, progress=not args.no_progress)
    print(format_table(res))
    print(f"wrote {args.out}")
    return 0


def format_table(res: dict) -> str:
    lines = [f"{'method':<14}{'tok/s':>8}{'speedup':>9}{'tau':>7}{'draft ms':>10}{'search ms':>11}{'verify ms':>11}{'match_ar':>10}"]
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for m, d in res["methods"].items():
        lines.append(f"{m:<14}{f(d['tokens_per_s'], 1):>8}{f(d.get('speedup_vs_ar')):>9}{f(d['tau']):>7}"
                     f"{f(d['draft_ms'], 1):>10}{f(d['search_ms'], 1):>11}{f(d['verify_ms'], 1):>11}{f(d.get('match_ar')):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return {"generate": cmd_generate, "bench": cmd_bench}[args.command](args)
    except DartLabError as e:
        print(f"dart-lab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dart-lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
