"""`dart-lab bench`: every method on the same prompts, interleaved, one run, one JSON.

Rules (so ratios mean something on a noisy machine):
- same prompts, chat template, max_new_tokens and stop rule (EOS) for all methods;
- warm-up generations per method before timing; methods interleaved per prompt, rotating the order;
- tokens counted as new token ids, identically for every method (generate.py);
- time = prefill + decode wall time of one generation (HF `generate` cannot split them); prefill
  is also reported on its own;
- tokens_per_s = sum of new tokens / sum of times over the prompts; speedup_vs_ar = that over AR's
  (equal to the ratio of total times when outputs are identical, as at T=0); the median of
  per-prompt ratios is given beside it;
- tau = mean tokens emitted per verify step, bonus included;
- match_ar (T=0) = fraction of prompts whose output equals AR's token for token.
Rows are appended to OUT.partial.jsonl as each prompt finishes; an interrupted run with the same
config resumes from them. The final JSON is written atomically.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import __version__
from .config import GenerationConfig
from .data import load_prompts
from .atomic import write_json
from .errors import DartLabError
from .methods import METHODS, MethodOptions, make_drafter

WARMUP_PROMPT = "Say hello and introduce yourself in one sentence."


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple = ("ar", "dart")
    dataset: str = "mt_bench"
    num_prompts: int = 10
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    warmup: int = 1
    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    options: MethodOptions = field(default_factory=MethodOptions)

    def __post_init__(self):
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise DartLabError(f"unknown method {bad[0]!r}; choose from {', '.join(METHODS)}")
        if not self.methods:
            raise DartLabError("no methods given")
        if self.num_prompts < 1:
            raise DartLabError(f"num_prompts must be >= 1, got {self.num_prompts}")
        self.generation()  # validates sampling settings

    def generation(self, seed: int | None = None) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                top_k=self.top_k, seed=self.seed if seed is None else seed)

    def key(self) -> str:
        """Identifies rows that can be reused on resume (num_prompts excluded: a larger run reuses them)."""
        d = asdict(self)
        d.pop("num_prompts")
        d["dart_lab"] = __version__  # a new version may draft differently (e.g. the faithful search of 0.2)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def machine_info(target) -> dict:
    import transformers

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "processor": platform.processor(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(target.device), "dtype": str(target.dtype), "torch_threads": torch.get_num_threads(),
            "dtype_report": target.dtype_report}
    if target.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(target.device)
    return info


def _run_one(method, target, ids, gen_cfg, drafters):
    from .generate import generate, hf_generate

    if method == "hf":
        return hf_generate(target, ids, gen_cfg)
    if method == "hf-pld":
        return hf_generate(target, ids, gen_cfg, prompt_lookup_num_tokens=10)
    return generate(target, ids, drafters[method], gen_cfg)


def _row(res, prompt, method, ar_tokens):
    steps = res.steps
    mean = (lambda k: statistics.fmean(s[k] for s in steps)) if steps else (lambda k: 0.0)
    row = {"prompt_id": prompt["id"], "category": prompt["category"], "method": method,
           "new_tokens": res.new_tokens, "total_s": res.total_s, "prefill_s": res.prefill_s, "decode_s": res.decode_s,
           "tokens_per_s": res.tokens_per_s, "verify_steps": len(steps),
           "emitted": sum(s["accept_len"] + 1 for s in steps),
           "tau": res.tau if steps else None, "draft_ms": mean("draft_ms"), "search_ms": mean("search_ms"),
           "verify_ms": mean("verify_ms"), "accept_lens": [s["accept_len"] for s in steps],
           "stop_reason": res.stop_reason}
    if ar_tokens is not None:
        row["match_ar"] = res.tokens == ar_tokens
        if not row["match_ar"]:
            n = min(len(res.tokens), len(ar_tokens))
            row["first_divergence"] = next((i for i in range(n) if res.tokens[i] != ar_tokens[i]), n)
    return row


def aggregate(rows: list[dict], methods, greedy: bool) -> dict:
    by = {m: [r for r in rows if r["method"] == m] for m in methods}
    ar_rows = {r["prompt_id"]: r for r in by.get("ar", [])}
    out = {}
    for m, rs in by.items():
        if not rs:
            continue
        tok = sum(r["new_tokens"] for r in rs)
        t = sum(r["total_s"] for r in rs)
        steps = sum(r["verify_steps"] for r in rs)
        d = {"n_prompts": len(rs), "new_tokens": tok, "total_s": t, "tokens_per_s": tok / max(t, 1e-9),
             "prefill_s_mean": statistics.fmean(r["prefill_s"] for r in rs),
             "tau": (sum(r["emitted"] for r in rs) / steps) if steps else None}
        for k in ("draft_ms", "search_ms", "verify_ms"):
            w = [(r[k], r["verify_steps"]) for r in rs if r["verify_steps"]]
            d[k] = sum(a * b for a, b in w) / max(sum(b for _, b in w), 1) if w else None
        if d["verify_ms"]:
            d["draft_search_share"] = (d["draft_ms"] + d["search_ms"]) / (d["draft_ms"] + d["search_ms"] + d["verify_ms"])
        if ar_rows:
            ar_tok = sum(ar_rows[r["prompt_id"]]["new_tokens"] for r in rs if r["prompt_id"] in ar_rows)
            ar_t = sum(ar_rows[r["prompt_id"]]["total_s"] for r in rs if r["prompt_id"] in ar_rows)
            if ar_t > 0:
                d["speedup_vs_ar"] = d["tokens_per_s"] / (ar_tok / ar_t)
            ratios = [r["tokens_per_s"] / ar_rows[r["prompt_id"]]["tokens_per_s"] for r in rs if r["prompt_id"] in ar_rows]
            d["speedup_vs_ar_median"] = statistics.median(ratios) if ratios else None
        if greedy and "match_ar" in rs[0]:
            d["match_ar"] = sum(r["match_ar"] for r in rs) / len(rs)
        hist = {}
        for r in rs:
            for a in r["accept_lens"]:
                hist[a] = hist.get(a, 0) + 1
        d["accept_len_hist"] = {str(k): hist[k] for k in sorted(hist)}
        out[m] = d
    return out


def run_bench(cfg: BenchConfig, out: str | Path, target=None, progress: bool = True) -> dict:
    """Run the benchmark described by `cfg`, write `out` (JSON) and return the result dict."""
    from .target import load_target

    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DartLabError(f"cannot create output folder {out.parent}: {e.strerror}") from None
    if not os.access(out.parent, os.W_OK):
        raise DartLabError(f"output folder {out.parent} is not writable")
    prompts = load_prompts(cfg.dataset, cfg.num_prompts)
    target = target or load_target(cfg.model, device=cfg.device, dtype=cfg.dtype)
    shared: dict = {}
    drafters = {m: make_drafter(m, target, cfg.options, shared) for m in cfg.methods}
    greedy = cfg.temperature == 0.0
    partial = out.with_name(out.name + ".partial.jsonl")
    key = cfg.key()
    rows = []
    if partial.is_file():
        for line in partial.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interruption
            if rec.get("config_key") == key:
                rows.append(rec["row"])
    done = {(r["prompt_id"], r["method"]) for r in rows}

    # warm-up: every method, discarded
    wids = target.encode_prompt(WARMUP_PROMPT)
    for _ in range(cfg.warmup):
        for m in cfg.methods:
            _run_one(m, target, wids, dataclasses.replace(cfg.generation(), max_new_tokens=min(32, cfg.max_new_tokens)), drafters)

    it = prompts
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(prompts, desc=f"bench {cfg.dataset}", unit="prompt")
    order = list(cfg.methods)
    if "ar" in order:  # AR first in the list so match_ar can be judged; timing order still rotates
        order.remove("ar")
        order.insert(0, "ar")
    for i, prompt in enumerate(it):
        if all((prompt["id"], m) in done for m in order):
            continue
        ids = target.encode_prompt(prompt["prompt"])
        gen_cfg = cfg.generation(seed=cfg.seed + i)
        rot = order[i % len(order):] + order[:i % len(order)]
        results = {m: _run_one(m, target, ids, gen_cfg, drafters) for m in rot}
        ar_tokens = results["ar"].tokens if ("ar" in results and greedy) else None
        new_rows = [_row(results[m], prompt, m, ar_tokens) for m in order]
        with open(partial, "a") as f:
            for r in new_rows:
                f.write(json.dumps({"config_key": key, "row": r}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        rows = [r for r in rows if r["prompt_id"] != prompt["id"]] + new_rows

    result = {"config": asdict(cfg), "config_key": key, "machine": machine_info(target),
              "drafters": {m: (d.config() if d is not None else {"name": m}) for m, d in drafters.items()},
              "aggregation": "tokens_per_s = sum(new_tokens)/sum(prefill+decode seconds) over prompts; "
                             "speedup_vs_ar = tokens_per_s / AR tokens_per_s on the same prompts; "
                             "speedup_vs_ar_median = median over prompts of the per-prompt ratio; "
                             "tau = emitted tokens / verify steps (bonus included)",
              "methods": aggregate(rows, order, greedy), "per_prompt": rows}
    write_json(out, result)
    partial.unlink(missing_ok=True)
    return result


@torch.no_grad()
def verify_latency(target, sizes=(1, 2, 4, 8, 16, 32, 64), repeats: int = 5, prompt_len: int = 64) -> dict:
    """Median wall time (ms) of one target verify over a chain-shaped tree of each size, after a
    prompt of `prompt_len` tokens: the cost side of speculative decoding on this machine."""
    import time

    from .tree import Tree

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, min(target.vocab_size, 1000), (prompt_len,), generator=g)
    out = {}
    for n in sizes:
        ts = []
        for _ in range(repeats + 1):
            target.prefill(prompt)
            tree = Tree(torch.randint(3, 1000, (n,), generator=g), torch.arange(-1, n - 1))
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            target.verify(tree)
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) * 1e3)
            target.commit([0])
        out[n] = statistics.median(ts[1:])
    return out
