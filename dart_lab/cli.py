"""Command line: `dart-lab generate ...` (also `python -m dart_lab`).

Errors a user can cause are printed as one line on stderr with a non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
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

    f = sub.add_parser("features", help="one target pass over ShareGPT: the feature cache for training")
    f.add_argument("--target", default="smollm2-135m")
    f.add_argument("--out", required=True, help="feature folder (train/ and val/ inside)")
    f.add_argument("--num-train", type=int, default=3072)
    f.add_argument("--num-val", type=int, default=64)
    f.add_argument("--val-skip", type=int, default=17000, help="validation conversations start here (held out)")
    f.add_argument("--max-len", type=int, default=512)
    f.add_argument("--device", default="auto")
    f.add_argument("--dtype", default="auto")
    f.add_argument("--conversations", default=None, help="train on a `dart-lab regenerate` folder instead of ShareGPT")
    f.add_argument("--val-conversations", default=None, help="validation from a regenerate folder (from its start)")
    f.add_argument("--max-turns", type=int, default=0, help="keep the first N user/assistant exchanges (0 = all)")

    r = sub.add_parser("regenerate", help="rewrite ShareGPT answers with the target (training data)")
    r.add_argument("--target", default="smollm2-135m")
    r.add_argument("--out", required=True, help="folder of chunk_*.jsonl (resumable)")
    r.add_argument("--num", type=int, required=True, help="conversations to regenerate")
    r.add_argument("--skip", type=int, default=0, help="start at this ShareGPT record")
    r.add_argument("--max-turns", type=int, default=1)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="auto")
    r.add_argument("--dtype", default="auto")

    t = sub.add_parser("train", help="train a DART or EAGLE-3 head from a feature cache")
    t.add_argument("kind", help="dart | eagle3")
    t.add_argument("--target", default="smollm2-135m")
    t.add_argument("--features", default=None, help="feature cache folder (from `dart-lab features`)")
    t.add_argument("--online", action="store_true", help="no cache: the target computes features in the loop")
    t.add_argument("--num-train", type=int, default=3072, help="--online: training conversations")
    t.add_argument("--num-val", type=int, default=64, help="--online: held-out conversations")
    t.add_argument("--conversations", default=None, help="--online: a `dart-lab regenerate` folder")
    t.add_argument("--max-turns", type=int, default=0, help="--online: first N exchanges only (0 = all)")
    t.add_argument("--out", required=True)
    t.add_argument("--max-steps", type=int, default=600)
    t.add_argument("--time-budget", type=float, default=0.0, help="minutes; stop early when reached")
    t.add_argument("--gamma", type=float, default=0.6)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--draft-vocab-size", type=int, default=8192)
    t.add_argument("--draft-length", type=int, default=7)
    t.add_argument("--seqs-per-step", type=int, default=2)
    t.add_argument("--anchors-per-seq", type=int, default=64)
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--val-every", type=int, default=100)
    t.add_argument("--val-examples", type=int, default=16, help="held-out conversations for alpha / tau")
    t.add_argument("--warmup-steps", type=int, default=30)
    t.add_argument("--init-from", default="", help="continue from a trained head folder (e.g. fine-tune)")
    t.add_argument("--unshifted", action="store_true", help="DART: level 0 from the first mask (Table 3 ablation)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto")
    t.add_argument("--dtype", default="auto")

    e = sub.add_parser("eval-head", help="held-out alpha / acc / hit@10 / chain tau of a trained head")
    e.add_argument("kind", help="dart | eagle3")
    e.add_argument("--head", default="", help="head folder (default: the shipped head for the target)")
    e.add_argument("--target", default="smollm2-135m")
    e.add_argument("--features", required=True, help="feature folder (its val/ split is used)")
    e.add_argument("--num", type=int, default=64)
    e.add_argument("--device", default="auto")

    x = sub.add_parser("export-head", help="write a head for the released engines (adds the target's embed_tokens)")
    x.add_argument("kind", help="dart | eagle3")
    x.add_argument("--head", default="", help="head folder (default: the shipped head for the target)")
    x.add_argument("--target", default="smollm2-135m")
    x.add_argument("--out", required=True, help="output folder (written atomically)")

    n = sub.add_parser("build-ngram", help="count 1/2/3-grams of a corpus with the target tokenizer")
    n.add_argument("--target", default="smollm2-135m")
    n.add_argument("--corpus", default="sharegpt", help="sharegpt | jsonl:PATH (a 'text' field per row)")
    n.add_argument("--max-tokens", type=int, default=0)
    n.add_argument("--out", default="", help="also save the table here (.npz); it is always cached")
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


def cmd_features(args) -> int:
    from .features import extract_features
    from .target import load_target

    target = load_target(args.target, device=args.device, dtype=args.dtype)
    extract_features(target, args.out, args.num_val, args.max_len, split="val",
                     skip=0 if args.val_conversations else args.val_skip, conversations=args.val_conversations,
                     max_turns=args.max_turns)
    extract_features(target, args.out, args.num_train, args.max_len, split="train", conversations=args.conversations,
                     max_turns=args.max_turns)
    print(f"features in {args.out}")
    return 0


def cmd_regenerate(args) -> int:
    from .regenerate import regenerate
    from .target import load_target

    if args.num < 1:
        raise DartLabError("--num must be >= 1 (conversations to regenerate)")
    if args.max_turns < 1 or args.max_new_tokens < 1:
        raise DartLabError("--max-turns and --max-new-tokens must be >= 1")
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    out = regenerate(target, args.out, args.num, skip=args.skip, max_turns=args.max_turns,
                     max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=args.batch_size,
                     seed=args.seed)
    print(f"regenerated conversations in {out}")
    return 0


def cmd_train(args) -> int:
    from .target import load_target
    from .train import TrainConfig, train_head

    cfg = TrainConfig(kind=args.kind, max_steps=args.max_steps, time_budget_min=args.time_budget, gamma=args.gamma,
                      lr=args.lr, draft_vocab_size=args.draft_vocab_size, draft_length=args.draft_length,
                      seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq,
                      save_every=args.save_every, val_every=args.val_every, seed=args.seed,
                      val_examples=args.val_examples, warmup_steps=args.warmup_steps, shifted=not args.unshifted,
                      init_from=args.init_from)
    if bool(args.features) == args.online:
        raise DartLabError("give either --features DIR or --online")
    device = args.device
    if device == "auto" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch

        # under `accelerate launch` each process drives its own GPU (LOCAL_RANK); CPU processes share the CPU
        if torch.cuda.is_available():
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    target = load_target(args.target, device=device, dtype=args.dtype)
    features = args.features
    if args.online:
        from .features import online_features

        features = online_features(target, args.num_train, args.num_val, conversations=args.conversations,
                                   max_turns=args.max_turns)
    summary = train_head(target, features, args.out, cfg)
    print(json.dumps({k: summary[k] for k in ("steps", "tokens_seen", "wall_time_s", "validation")}))
    return 0


def cmd_eval_head(args) -> int:
    import torch

    from .methods import load_head
    from .target import load_target
    from .train import evaluate_head

    if args.kind not in ("dart", "eagle3"):
        raise DartLabError(f"unknown head kind {args.kind!r}: dart or eagle3")
    target = load_target(args.target, device=args.device, dtype="fp32")
    head = load_head(target, args.kind, args.head, random_heads=False).to(torch.float32)
    print(json.dumps(evaluate_head(target, head, args.features, args.kind, args.num)))
    return 0


def cmd_export_head(args) -> int:
    from pathlib import Path

    from .methods import load_head, shipped_head
    from .target import load_target

    if args.kind not in ("dart", "eagle3"):
        raise DartLabError(f"unknown head kind {args.kind!r}: dart or eagle3")
    target = load_target(args.target, device="cpu", dtype="fp32")
    head = load_head(target, args.kind, args.head, random_heads=False)
    src = Path(args.head) if args.head else shipped_head(target, args.kind)
    card = (src / "README.md").read_text() if src and (src / "README.md").is_file() else None
    out = head.save(args.out, extra_card=card, with_embedding=True)
    print(f"exported {args.kind} head to {out} (final norm twice: {head.cfg.final_norm_twice})")
    return 0


def cmd_build_ngram(args) -> int:
    from .ngram import build_ngram
    from .target import load_target

    target = load_target(args.target, device="cpu", dtype="fp32")
    ng = build_ngram(target.tokenizer, args.corpus, max_tokens=args.max_tokens or None, progress=True)
    if args.out:
        ng.save(args.out)
    print(json.dumps({"meta": ng.meta, **ng.num_ngrams}))
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
        cmds = {"generate": cmd_generate, "bench": cmd_bench, "features": cmd_features, "train": cmd_train,
                "build-ngram": cmd_build_ngram, "regenerate": cmd_regenerate,
                "eval-head": cmd_eval_head, "export-head": cmd_export_head}
        return cmds[args.command](args)
    except DartLabError as e:
        print(f"dart-lab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dart-lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
