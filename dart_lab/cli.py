"""Command line: `dart-lab generate ...` (also `python -m dart_lab`).

Errors a user can cause are printed as one line on stderr with a non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from .bench import BenchConfig, run_bench
from .config import GenerationConfig
from .errors import DartLabError
from .features import extract_features, online_features
from .loading import load_target
from .methods import METHODS, MethodOptions, get_method, load_head, make_runner, shipped_head
from .ngram import build_ngram
from .regenerate import regenerate
from .config import TrainConfig
from .train import evaluate_head, train_head


def add_fields(p: argparse.ArgumentParser, cls, skip=(), rename: dict | None = None, helps: dict | None = None) -> None:
    """One flag per field of the frozen dataclass `cls`, default and help taken from the field (the
    one source of defaults). Booleans: a flag that flips the default (`rename` names it)."""
    rename, helps = rename or {}, helps or {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + rename.get(f.name, f.name).replace("_", "-")
        default = f.default
        text = helps.get(f.name) or f.metadata.get("help", "")
        if isinstance(default, bool):
            p.add_argument(flag, dest=f.name, action="store_false" if default else "store_true", help=text)
        else:
            p.add_argument(flag, dest=f.name, type=type(default), default=default,
                           help=f"{text} (default: {default!r})" if text else f"default: {default!r}")


def from_fields(cls, args, **extra):
    """The dataclass built from the flags `add_fields` declared."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names and k not in extra}, **extra)


def _add_target_args(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    # --model is the former name of --target, kept so that older commands still run
    p.add_argument("--target", "--model", dest="target", default="smollm2-135m",
                   help="embedded name or HF id/path of the target")
    p.add_argument("--device", default="auto")
    if dtype:
        p.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16 | int4 (4-bit weight-only matmuls, fast runner on a CPU)")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    _add_target_args(p)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's steps (fast runner; tens of seconds of compiling per new step shape on a small CPU;"
                        " one request at a time: batched steps stay eager)")
    add_fields(p, GenerationConfig, skip=("stop_on_eos",))
    add_fields(p, MethodOptions)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dart-lab", description="DART speculative decoding lab")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from one prompt, or several decoded together")
    g.add_argument("--method", default="ar", help="; ".join(f"{m.name}: {m.help}" for m in METHODS.values()))
    g.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch decoded together")
    g.add_argument("--prompts-file", default="", help="one prompt per line, all decoded together (with --prompt's)")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--max-rows", type=int, default=0, help="several prompts: at most this many decode at once, the "
                   "others join as rows finish (continuous batching; 0 = all at once)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    _add_generation_args(g)
    b = sub.add_parser("bench", help="benchmark methods on a dataset (one JSON)")
    b.add_argument("--methods", default="ar,dart", help="comma list of: " + ", ".join(METHODS))
    b.add_argument("--dataset", default="mt_bench", help="mt_bench | humaneval | gsm8k | code_alpaca | alpaca | jsonl:PATH")
    b.add_argument("--num-prompts", type=int, default=BenchConfig.num_prompts)
    b.add_argument("--warmup", type=int, default=BenchConfig.warmup)
    b.add_argument("--repeats", type=int, default=BenchConfig.repeats,
                   help="T=0: run each prompt this many times per method, count the fastest (a noisy host)")
    b.add_argument("--batch-size", default="1", help="comma list of batch sizes, e.g. 1,2,4,8,16: prompts decoded "
                   "together (the paper's Tables 5-7), the sizes interleaved in the run; the first fills the table, "
                   "every size the JSON's by_batch")
    b.add_argument("--continuous", action="store_true", help="batches: B rows at once over all the prompts, a "
                   "finished row's place going to the next prompt (continuous batching), instead of groups of B")
    b.add_argument("--out", required=True, help="output JSON file")
    b.add_argument("--no-progress", action="store_true")
    _add_generation_args(b)

    c = sub.add_parser("calibrate", help="the automatic tree budget's measurements on this machine (cost curve, "
                       "calibration): show them, or re-measure with --refresh")
    c.add_argument("--methods", default="dart", help="comma list of budgeted methods (dart, dart-ctx, eagle3, ...)")
    c.add_argument("--refresh", action="store_true", help="measure again now and replace the cached measurements "
                   "(run it on an idle machine: a measurement taken while other work uses the cores is never cached)")
    _add_target_args(c)
    add_fields(c, MethodOptions)

    f = sub.add_parser("features", help="one target pass over ShareGPT: the feature cache for training")
    f.add_argument("--target", "--model", dest="target", default="smollm2-135m")
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
    r.add_argument("--target", "--model", dest="target", default="smollm2-135m")
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
    t.add_argument("--target", "--model", dest="target", default="smollm2-135m")
    t.add_argument("--features", default=None, help="feature cache folder (from `dart-lab features`)")
    t.add_argument("--online", action="store_true", help="no cache: the target computes features in the loop")
    t.add_argument("--num-train", type=int, default=3072, help="--online: training conversations")
    t.add_argument("--num-val", type=int, default=64, help="--online: held-out conversations")
    t.add_argument("--conversations", default=None, help="--online: a `dart-lab regenerate` folder")
    t.add_argument("--max-turns", type=int, default=0, help="--online: first N exchanges only (0 = all)")
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="auto")
    t.add_argument("--dtype", default="auto")
    add_fields(t, TrainConfig, skip=("kind",), rename={"time_budget_min": "time_budget", "shifted": "unshifted",
                                                      "autocast": "no_autocast", "init_from_target": "no_init_from_target"},
               helps={"time_budget_min": "minutes; stop early when reached (0 = no limit)",
                      "shifted": "DART: level 0 from the first mask (Table 3 ablation)",
                      "init_from": "continue from a trained head folder (e.g. fine-tune)",
                      "val_examples": "held-out conversations for alpha / tau"})

    e = sub.add_parser("eval-head", help="held-out alpha / acc / hit@10 / chain tau of a trained head")
    e.add_argument("kind", help="dart | eagle3")
    e.add_argument("--head", default="", help="head folder (default: the shipped head for the target)")
    e.add_argument("--target", "--model", dest="target", default="smollm2-135m")
    e.add_argument("--features", required=True, help="feature folder (its val/ split is used)")
    e.add_argument("--num", type=int, default=64)
    e.add_argument("--device", default="auto")

    x = sub.add_parser("export-head", help="write a head for the released engines (adds the target's embed_tokens)")
    x.add_argument("kind", help="dart | eagle3")
    x.add_argument("--head", default="", help="head folder (default: the shipped head for the target)")
    x.add_argument("--target", "--model", dest="target", default="smollm2-135m")
    x.add_argument("--out", required=True, help="output folder (written atomically)")

    n = sub.add_parser("build-ngram", help="count 1/2/3-grams of a corpus with the target tokenizer")
    n.add_argument("--target", "--model", dest="target", default="smollm2-135m")
    n.add_argument("--corpus", default="sharegpt", help="sharegpt | jsonl:PATH (a 'text' field per row)")
    n.add_argument("--max-tokens", type=int, default=0)
    n.add_argument("--out", default="", help="also save the table here (.npz); it is always cached")
    return ap


def _options(args) -> MethodOptions:
    return from_fields(MethodOptions, args)


def _prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            prompts += [ln for ln in Path(args.prompts_file).read_text().splitlines() if ln.strip()]
        except OSError as e:
            raise DartLabError(f"cannot read --prompts-file {args.prompts_file}: {e.strerror}") from None
    if not prompts:
        raise DartLabError("no prompt given: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    if any(not p.strip() for p in prompts):
        raise DartLabError("prompt is empty")
    return prompts


def cmd_generate(args) -> int:
    prompts = _prompts(args)
    cfg = from_fields(GenerationConfig, args)
    get_method(args.method)  # a bad name is refused before the target loads (and times its dtype)
    if args.max_rows < 0:
        raise DartLabError(f"--max-rows must be >= 0, got {args.max_rows}")
    target = load_target(args.target, device=args.device, dtype=args.dtype, compile=args.compile)
    runner = make_runner(args.method, target, _options(args))
    ids = [target.encode_prompt(p, chat=not args.no_chat_template) for p in prompts]
    if len(ids) > 1:
        res = runner.generate_batch(ids, cfg, max_rows=args.max_rows or None)
        if args.json:
            print(json.dumps({"texts": [r.text for r in res.rows], "new_tokens": [r.new_tokens for r in res.rows],
                              "tokens_per_s": round(res.tokens_per_s, 3), "batch_size": res.batch_size,
                              "prefill_s": res.prefill_s, "decode_s": res.decode_s,
                              "stop_reasons": [r.stop_reason for r in res.rows], "method": res.method,
                              "target": args.target, "dtype": target.precision, "device": str(target.device),
                              "config": res.config}))
        else:
            print("\n\n".join(f"[{i}] {r.text}" for i, r in enumerate(res.rows)))
        return 0
    res = runner.generate(ids[0], cfg)
    if args.json:
        print(json.dumps({"text": res.text, "new_tokens": res.new_tokens, "tokens_per_s": round(res.tokens_per_s, 3),
                          "tau": res.tau, "prefill_s": res.prefill_s, "decode_s": res.decode_s,
                          "stop_reason": res.stop_reason, "method": res.method, "target": args.target,
                          "dtype": target.precision, "device": str(target.device), "config": res.config}))
    else:
        print(res.text)
    return 0


def _batch_sizes(text: str) -> tuple:
    try:
        sizes = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise DartLabError(f"--batch-size takes a comma list of integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise DartLabError(f"--batch-size takes integers >= 1, got {text!r}")
    return sizes


def cmd_bench(args) -> int:
    g = from_fields(GenerationConfig, args)
    cfg = BenchConfig(methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()), dataset=args.dataset,
                      num_prompts=args.num_prompts, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                      top_p=g.top_p, top_k=g.top_k, seed=g.seed, warmup=args.warmup, repeats=args.repeats, model=args.target,
                      device=args.device, dtype=args.dtype, compile=args.compile, options=_options(args),
                      batch_sizes=_batch_sizes(args.batch_size), continuous=args.continuous)
    res = run_bench(cfg, args.out, progress=not args.no_progress)
    print(format_table(res))
    for B, block in res.get("by_batch", {}).items():
        if B != str(cfg.batch_sizes[0]):
            print(f"\nbatch size {B}\n" + format_table({"methods": block["methods"]}))
    sm = res.get("step_vs_memory")
    if sm:
        print(f"one-token step: {sm['ar_step_ms']:.1f} ms for {sm['weight_mb']:.0f} MB of weights = "
              f"{sm['weight_read_gbs']:.1f} GB/s, {100 * sm['fraction_of_read_bandwidth']:.0f} % of this machine's "
              f"memory read bandwidth ({sm['memory_read_gbs']:.1f} GB/s)")
    load = res["machine_load"]
    if load["contended"]:
        print(f"WARNING: contended run: other processes used {load['others_cores']:.2f} cores on average; "
              "timings are not those of an idle machine")
    print(f"wrote {args.out}")
    return 0


def cmd_calibrate(args) -> int:
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    opts = _options(args)
    for m in (x.strip() for x in args.methods.split(",") if x.strip()):
        if not get_method(m).budgeted:
            raise DartLabError(f"method {m!r} has no tree budget to calibrate")
        r = make_runner(m, target, opts, refresh=args.refresh)
        if r.budget is None:
            raise DartLabError(f"method {m!r}: the tree budget is fixed (--tree-nodes {opts.tree_nodes}), nothing to calibrate")
        c, b = r.controller.cost, r.budget
        load = c.get("machine_load") or {}
        print(f"{m}: theta {b['theta']} (expected {b['expected_speedup_vs_ar']:.2f}x AR"
              f"{', AR fallback' if b['fallback_to_ar'] else ''}); verify ms by nodes "
              + " ".join(f"{n}:{v:.1f}" for n, v in c["verify_ms"].items())
              + f"; {'measured now' if not c['cached'] else 'cached'}"
              + (f", {c['age_s'] / 3600:.1f} h old" if c.get("age_s") is not None else "")
              + (f", others used {load['others_cores']:.2f} cores" if load else "")
              + (" (CONTENDED: used for this run only, not cached)" if c.get("contended") else ""))
    return 0


def cmd_features(args) -> int:
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    extract_features(target, args.out, args.num_val, args.max_len, split="val",
                     skip=0 if args.val_conversations else args.val_skip, conversations=args.val_conversations,
                     max_turns=args.max_turns)
    extract_features(target, args.out, args.num_train, args.max_len, split="train", conversations=args.conversations,
                     max_turns=args.max_turns)
    print(f"features in {args.out}")
    return 0


def cmd_regenerate(args) -> int:
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
    cfg = from_fields(TrainConfig, args, kind=args.kind)
    if bool(args.features) == args.online:
        raise DartLabError("give either --features DIR or --online")
    device = args.device
    # under `accelerate launch` each process drives its own GPU (LOCAL_RANK); CPU processes share the CPU
    if device == "auto" and int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    target = load_target(args.target, device=device, dtype=args.dtype)
    features = args.features
    if args.online:
        features = online_features(target, args.num_train, args.num_val, conversations=args.conversations,
                                   max_turns=args.max_turns)
    summary = train_head(target, features, args.out, cfg)
    print(json.dumps({k: summary[k] for k in ("steps", "tokens_seen", "wall_time_s", "validation")}))
    return 0


def _head_kind(kind: str) -> str:
    if kind not in ("dart", "eagle3"):
        raise DartLabError(f"unknown head kind {kind!r}: dart or eagle3")
    return kind


def cmd_eval_head(args) -> int:
    target = load_target(args.target, device=args.device, dtype="fp32")
    head = load_head(target, _head_kind(args.kind), args.head, random_heads=False).to(torch.float32)
    print(json.dumps(evaluate_head(target, head, args.features, args.kind, args.num)))
    return 0


def cmd_export_head(args) -> int:
    target = load_target(args.target, device="cpu", dtype="fp32")
    head = load_head(target, _head_kind(args.kind), args.head, random_heads=False)
    src = Path(args.head) if args.head else shipped_head(target, args.kind)
    card = (src / "README.md").read_text() if src and (src / "README.md").is_file() else None
    out = head.save(args.out, extra_card=card, with_embedding=True)
    print(f"exported {args.kind} head to {out} (final norm twice: {head.cfg.final_norm_twice})")
    return 0


def cmd_build_ngram(args) -> int:
    target = load_target(args.target, device="cpu", dtype="fp32")
    ng = build_ngram(target.tokenizer, args.corpus, max_tokens=args.max_tokens or None, progress=True)
    if args.out:
        ng.save(args.out)
    print(json.dumps({"meta": ng.meta, **ng.num_ngrams}))
    return 0


def format_table(res: dict) -> str:
    lines = [f"{'method':<14}{'tok/s':>8}{'speedup':>9}{'tau':>7}{'theta':>7}{'draft ms':>10}{'search ms':>11}"
             f"{'verify ms':>11}{'match_ar':>10}"]
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for m, d in res["methods"].items():
        budget = res.get("drafters", {}).get(m, {}).get("tree_budget")
        theta = "-" if budget is None else ("AR" if budget["fallback_to_ar"] else str(budget["theta"]))
        if "by_batch" in res or budget is None and d.get("theta_range"):  # batches: the thetas the runs chose
            theta = "-" if not d.get("theta_range") else "-".join(str(v) for v in sorted(set(d["theta_range"])))
        lines.append(f"{m:<14}{f(d['tokens_per_s'], 1):>8}{f(d.get('speedup_vs_ar')):>9}{f(d['tau']):>7}{theta:>7}"
                     f"{f(d['draft_ms'], 1):>10}{f(d['search_ms'], 1):>11}{f(d['verify_ms'], 1):>11}{f(d.get('match_ar')):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        cmds = {"generate": cmd_generate, "bench": cmd_bench, "calibrate": cmd_calibrate, "features": cmd_features, "train": cmd_train,
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
