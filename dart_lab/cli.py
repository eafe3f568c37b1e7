"""Command line: `dart-lab generate ...` (also `python -m dart_lab`).

Errors a user can cause are printed as one line on stderr with a non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys

from .errors import DartLabError

METHODS = ("ar", "hf")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="embedded name or HF id/path of the target")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dart-lab", description="DART speculative decoding lab")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from one prompt")
    g.add_argument("--method", default="ar", help="one of: " + ", ".join(METHODS))
    g.add_argument("--prompt", required=True)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    _add_generation_args(g)
    return ap


def cmd_generate(args) -> int:
    from .config import GenerationConfig
    from .generate import generate, hf_generate
    from .target import load_target

    if args.method not in METHODS:
        raise DartLabError(f"unknown method {args.method!r}; choose from {', '.join(METHODS)}")
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed)
    if not args.prompt.strip():
        raise DartLabError("prompt is empty")
    target = load_target(args.model, device=args.device, dtype=args.dtype)
    ids = target.encode_prompt(args.prompt, chat=not args.no_chat_template)
    res = hf_generate(target, ids, cfg) if args.method == "hf" else generate(target, ids, None, cfg)
    if args.json:
        print(json.dumps({"text": res.text, "new_tokens": res.new_tokens, "tokens_per_s": round(res.tokens_per_s, 3),
                          "tau": res.tau, "prefill_s": res.prefill_s, "decode_s": res.decode_s,
                          "stop_reason": res.stop_reason, "method": res.method, "model": args.model,
                          "dtype": str(target.dtype), "device": str(target.device), "config": res.config}))
    else:
        print(res.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return {"generate": cmd_generate}[args.command](args)
    except DartLabError as e:
        print(f"dart-lab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dart-lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
