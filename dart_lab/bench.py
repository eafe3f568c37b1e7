"""`dart-lab bench`: every method on the same prompts, interleaved, one run, one JSON.

Rules (so ratios mean something on a noisy machine):
- same prompts, chat template, max_new_tokens and stop rule (EOS) for all methods;
- warm-up generations per method before timing; methods interleaved per prompt, rotating the order;
  several batch sizes interleaved too (each size's groups in the order of their first prompt), so a
  machine whose speed drifts moves every size alike and batch B against one at a time holds;
- tokens counted as new token ids, identically for every method (generate.py);
- time = prefill + decode wall time of one generation (HF `generate` cannot split them); prefill
  is also reported on its own;
- tokens_per_s = sum of new tokens / sum of times over the prompts; speedup_vs_ar = that over AR's
  (equal to the ratio of total times when outputs are identical, as at T=0); the median of
  per-prompt ratios is given beside it;
- tau = mean tokens emitted per verify step, bonus included;
- match_ar (T=0) = fraction of prompts whose output equals AR's token for token;
- repeats R > 1 (T=0 only): every prompt is run R times per method, interleaved (the order rotates on
  each pass), and each (prompt, method) is counted by its fastest pass, as `timeit` counts the best of
  its repeats: a VM's host slows single generations by up to ~40 % in an otherwise quiet run, and a
  slow pass says nothing about the method. A greedy pass
  emits the same tokens every time, so only time is selected; `methods_first_pass` keeps the
  figures of the first pass alone. Sampling (T > 0) refuses R > 1: keeping the faster of two sampled
  runs would keep the luckier draws.
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
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

from .version import __version__
from .config import GenerationConfig
from .atomic import write_json
from .measure import say
from .data import load_prompts
from .errors import DartLabError
from .loading import load_target
from .machine import cpu_counters, machine_load, memory_read_gbs, weight_bytes
from .methods import MethodOptions, get_method, make_runner, unavailable_reason

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
    repeats: int = 1  # passes per (prompt, method) at T=0; the fastest counts (module docstring)
    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False  # torch.compile the target's steps (runner.FastTarget.compile)
    # requests decoded together (batch.py); 1 = one at a time (the paper's Tables 1-4), more: Tables 5-7.
    # The first size fills `methods`, every size `by_batch`; the sizes' work interleaved in one run
    batch_sizes: tuple = (1,)
    # batches: False = the prompts in consecutive groups of B, each decoded until its last row finishes;
    # True = continuous batching, B rows at once over all prompts, a finished row's place going to the next
    # prompt (batch.generate_batch's max_rows), as a server keeps its batch full
    continuous: bool = False
    options: MethodOptions = field(default_factory=MethodOptions)

    def __post_init__(self):
        for m in self.methods:
            get_method(m)
        if not self.methods:
            raise DartLabError("no methods given")
        if self.num_prompts < 1:
            raise DartLabError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise DartLabError(f"batch sizes must be integers >= 1, got {self.batch_sizes!r}")
        if self.continuous and any(get_method(m).hf for m in self.methods):
            raise DartLabError("continuous batching runs dart_lab's decoders; HF generate decodes static batches "
                               "(drop hf/hf-pld from the methods or --continuous)")
        if self.repeats < 1:
            raise DartLabError(f"repeats must be >= 1, got {self.repeats}")
        if self.repeats > 1 and self.temperature > 0:
            raise DartLabError("repeats > 1 needs temperature 0: keeping the faster of two sampled runs keeps the luckier draws")
        self.generation()  # validates sampling settings

    def generation(self, seed: int | None = None) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                top_k=self.top_k, seed=self.seed if seed is None else seed)

    def key(self) -> str:
        """Identifies rows that can be reused on resume (num_prompts excluded: a larger run reuses them)."""
        d = asdict(self)
        d.pop("num_prompts")
        if tuple(d["batch_sizes"]) == (1,):  # the key of a one-at-a-time run, as before batches existed
            d.pop("batch_sizes")
        d["dart_lab"] = __version__  # a new version may draft differently (e.g. the faithful search of 0.2)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def machine_info(target) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "processor": platform.processor(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(target.device), "dtype": target.precision, "torch_threads": torch.get_num_threads(),
            "dtype_report": target.dtype_report}
    if getattr(target, "compile", False):  # time in first calls of new step shapes (in the measured runs too)
        info["compile_seconds"] = round(target.compile_seconds, 1)
    if target.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(target.device)
    return info


# top-1 minus top-2 logit under which a low-precision divergence from AR counts as a near-tie that
# rounding explains (bf16 keeps ~3 significant digits; logits of ~20 move by tenths through 30 layers)
NEAR_TIE_LOGITS = 1.0


def _divergence(row: dict, res, ar) -> None:
    """Where a method first left AR's tokens, and how close AR's call was there (top-1 minus top-2
    logit): in fp32 every method equals AR; in bf16 a divergence must sit at a near-tie."""
    n = min(len(res.tokens), len(ar.tokens))
    i = next((j for j in range(n) if res.tokens[j] != ar.tokens[j]), n)
    row["first_divergence"] = i
    row["divergence_margin"] = ar.margins[i] if i < len(ar.margins) else None


def _row(res, prompt, method, ar):
    steps = res.steps
    mean = (lambda k: statistics.fmean(s[k] for s in steps)) if steps else (lambda k: 0.0)
    row = {"prompt_id": prompt["id"], "category": prompt["category"], "method": method,
           "new_tokens": res.new_tokens, "total_s": res.total_s, "prefill_s": res.prefill_s, "decode_s": res.decode_s,
           "tokens_per_s": res.tokens_per_s, "verify_steps": len(steps),
           "emitted": sum(s["accept_len"] + 1 for s in steps),
           "tau": res.tau if steps else None, "draft_ms": mean("draft_ms"), "search_ms": mean("search_ms"),
           "verify_ms": mean("verify_ms"), "accept_lens": [s["accept_len"] for s in steps],
           "stop_reason": res.stop_reason,
           "theta": (res.config or {}).get("tree_budget", {}).get("theta"),  # auto budget: theta used
           "drafted_nodes": mean("tree_size") - 1 if steps and "tree_size" in steps[0] else 0.0,
           "copy_only_steps": sum(1 for s in steps if s.get("copy_only"))}
    if ar is not None:
        row["match_ar"] = res.tokens == ar.tokens
        if not row["match_ar"]:
            _divergence(row, res, ar)
    return row


def _batch_row(res, group: str, method: str, ar, batch_size: int) -> dict:
    """One bench row for a batch of prompts decoded together (`Runner.generate_batch`) in the run at
    `batch_size` (a last group with fewer prompts counts there too; `rows_at_once` says how many decoded
    together): tokens of every row over the batch's wall time; step figures per row-step (tau, drafting) or
    per batch step (verify); match_ar per row against batched AR on the same prompts."""
    steps = [s for r in res.rows for s in r.steps]
    mean = (lambda k: statistics.fmean(s[k] for s in steps)) if steps else (lambda k: 0.0)
    by_rows = (res.config or {}).get("tree_budget_by_rows") or {}
    row = {"prompt_id": group, "category": "batch", "method": method, "batch_size": batch_size,
           "rows_at_once": res.batch_size,
           "new_tokens": res.new_tokens, "total_s": res.wall_s, "prefill_s": res.prefill_s, "decode_s": res.decode_s,
           "tokens_per_s": res.tokens_per_s, "verify_steps": len(steps), "batch_steps": len(res.steps),
           "emitted": sum(s["accept_len"] + 1 for s in steps), "tau": None,
           "draft_ms": mean("draft_ms"), "search_ms": mean("search_ms"),
           "verify_ms": statistics.fmean(s["verify_ms"] for s in res.steps) if res.steps else 0.0,
           "accept_lens": [s["accept_len"] for s in steps],
           "stop_reason": ",".join(sorted({r.stop_reason for r in res.rows})),
           "theta": by_rows[str(res.batch_size)]["theta"] if str(res.batch_size) in by_rows else None,
           "theta_by_live_rows": {k: v["theta"] for k, v in by_rows.items()},
           # what the budget predicted for each live-row count it chose at (beside the measured speedup)
           "expected_speedup_by_live_rows": {k: round(v["expected_speedup_vs_ar"], 4) for k, v in by_rows.items()},
           "drafted_nodes": mean("tree_size") - 1 if steps and "tree_size" in steps[0] else 0.0,
           "copy_only_steps": sum(1 for s in steps if s.get("copy_only"))}
    row["tau"] = row["emitted"] / len(steps) if steps else None
    if ar is not None:
        row["match_ar_rows"] = [r.tokens == a.tokens for r, a in zip(res.rows, ar.rows)]
        row["match_ar"] = all(row["match_ar_rows"])
        first = next((i for i, m in enumerate(row["match_ar_rows"]) if not m), None)
        if first is not None:
            _divergence(row, res.rows[first], ar.rows[first])
    return row


def fastest_pass(rows: list[dict]) -> list[dict]:
    """One row per (prompt, method): the pass with the least total time (rows without a `repeat`
    field are single passes)."""
    best: dict = {}
    for r in rows:
        k = (r["prompt_id"], r["method"])
        if k not in best or r["total_s"] < best[k]["total_s"]:
            best[k] = r
    return list(best.values())


def ratio_interval(rows: list[dict], a: str, bs: list[str], n: int = 4000, seed: int = 0) -> tuple[float, float] | None:
    """95 % bootstrap interval of tokens/s of `a` over the faster of `bs`, resampling the prompts (paired:
    a drawn prompt brings every method's row, counted as the aggregate is, by its fastest pass). At T=1
    each method samples its own text, so a 10-prompt cell moves by several per cent between runs; the
    interval says which gaps the run can tell apart. rows: a result's `per_prompt`; None with < 2 prompts."""
    rows = fastest_pass(rows)
    by = {m: {r["prompt_id"]: r for r in rows if r["method"] == m} for m in [a] + bs}
    ids = sorted(set.intersection(*(set(v) for v in by.values())))
    if len(ids) < 2:
        return None
    tok = np.array([[by[m][i]["new_tokens"] for i in ids] for m in by], dtype=float)  # (methods, prompts)
    sec = np.array([[by[m][i]["total_s"] for i in ids] for m in by])
    draw = np.random.default_rng(seed).integers(0, len(ids), (n, len(ids)))
    speed = tok[:, draw].sum(-1) / sec[:, draw].sum(-1)  # (methods, n)
    lo, hi = np.percentile(speed[0] / speed[1:].max(0), [2.5, 97.5])
    return float(lo), float(hi)


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
            margins = [r["divergence_margin"] for r in rs if r.get("divergence_margin") is not None]
            d["divergences"] = len(margins)
            d["max_divergence_margin"] = max(margins) if margins else None
            d["unexplained_divergences"] = sum(1 for m in margins if m > NEAR_TIE_LOGITS)
        thetas = [r["theta"] for r in rs if r.get("theta") is not None]
        d["theta_range"] = [min(thetas), max(thetas)] if thetas else None
        w = [(r.get("drafted_nodes", 0.0), r["verify_steps"]) for r in rs if r["verify_steps"]]
        d["drafted_nodes_mean"] = sum(a * b for a, b in w) / max(sum(b for _, b in w), 1) if w else 0.0
        d["copy_only_share"] = sum(r.get("copy_only_steps", 0) for r in rs) / steps if steps else 0.0
        hist = {}
        for r in rs:
            for a in r["accept_lens"]:
                hist[a] = hist.get(a, 0) + 1
        d["accept_len_hist"] = {str(k): hist[k] for k in sorted(hist)}
        out[m] = d
    return out


def run_bench(cfg: BenchConfig, out: str | Path, target=None, progress: bool = True) -> dict:
    """Run the benchmark described by `cfg`, write `out` (JSON) and return the result dict."""
    out = _writable(Path(out))
    prompts = load_prompts(cfg.dataset, cfg.num_prompts)
    target = target or load_target(cfg.model, device=cfg.device, dtype=cfg.dtype, compile=cfg.compile)
    skipped, runners = _runners(cfg, target)
    partial = out.with_name(out.name + ".partial.jsonl")
    key = cfg.key()
    rows = _read_partial(partial, key)

    if getattr(target, "compile", False):  # every step shape the decodes can meet, compiled before any timing
        longest = max(target.encode_prompt(p["prompt"]).numel() for p in prompts)
        say(f"compiling the step shapes of decodes up to {longest + cfg.max_new_tokens} tokens (once per process)")
        target.precompile(longest + cfg.max_new_tokens + max(target.node_buckets))
    read_gbs = memory_read_gbs(device=target.device)  # before the timed runs: about a second
    load0, t_run = cpu_counters(), time.perf_counter()
    order = list(runners)
    if "ar" in order:  # AR first in the list so match_ar can be judged; timing order still rotates
        order.remove("ar")
        order.insert(0, "ar")
    one_at_a_time = cfg.batch_sizes[0] == 1  # the first size 1: each prompt alone through `Runner.generate`
    sizes = [B for B in cfg.batch_sizes if not (B == 1 and one_at_a_time)]
    batched = [m for m in order if get_method(m).batches]
    _warm_up(cfg, target, runners, batched, sizes, progress)
    rows = _run_units(cfg, target, prompts, runners, order, batched, sizes, one_at_a_time, partial, key, rows, progress)
    result = _result(cfg, key, target, runners, skipped, rows, order, batched, sizes, read_gbs,
                     machine_load(load0, time.perf_counter() - t_run))
    write_json(out, result)
    partial.unlink(missing_ok=True)
    return result


def _warm_up(cfg: BenchConfig, target, runners: dict, batched: list, sizes: list, progress: bool) -> None:
    """Every method decodes the warm-up prompt `cfg.warmup` times, discarded; each batch size's batched methods too
    (which also times each size's batched verify surface for the budget, outside the timing)."""
    wids = target.encode_prompt(WARMUP_PROMPT)
    warm = dataclasses.replace(cfg.generation(), max_new_tokens=min(32, cfg.max_new_tokens))
    for _ in range(cfg.warmup):
        for m in runners:
            if progress:
                say(f"bench warm-up: {m}")
            runners[m].generate(wids, warm)
    if getattr(target, "compile", False) and sizes and progress:
        say("batch sizes > 1 decode with eager steps: --compile compiles one request's steps only")
    for B in sizes:
        for _ in range(cfg.warmup):
            for m in batched:
                runners[m].generate_batch([wids] * B, warm)


def _units(cfg: BenchConfig, n_prompts: int, one_at_a_time: bool, sizes: list) -> list[tuple[int, int, int]]:
    """The work as (first prompt, batch size, group): a prompt alone, or a group of B prompts decoded together
    (consecutive groups; continuous batching: all prompts, B rows at once), in the order of their first prompt
    (the smaller size first): each size's share is spread over the whole run, so where the machine's speed drifts
    (a VM's neighbours) every size's figure moves alike and their ratios (batch B against one at a time) hold."""
    units = [(i, 1, i) for i in range(n_prompts)] if one_at_a_time else []
    for B in sizes:
        units += [(s, B, g) for g, s in enumerate([0] if cfg.continuous else range(0, n_prompts, B))]
    return sorted(units, key=lambda u: (u[0], u[1]))


def _run_units(cfg: BenchConfig, target, prompts, runners: dict, order: list, batched: list, sizes: list,
               one_at_a_time: bool, partial: Path, key, rows: list, progress: bool) -> list:
    """Decode every unit with every method (rotating which goes first), appending each unit's rows to `partial`
    as it finishes (an interrupted run resumes there); returns every row."""
    greedy = cfg.temperature == 0.0
    done = {(r["prompt_id"], r["method"], r.get("repeat", 0)) for r in rows}
    units = _units(cfg, len(prompts), one_at_a_time, sizes)
    it = tqdm(units, desc=f"bench {cfg.dataset}", unit="unit") if progress else units

    def generate(m: str, ids, gen_cfg, B: int):
        if progress:  # the bar names the batch size and method running: one unit takes seconds per method
            it.set_postfix_str(f"batch {B}: {m}" if B > 1 or not one_at_a_time else m)
        return runners[m].generate(ids, gen_cfg) if B == 1 and one_at_a_time else \
            runners[m].generate_batch(ids, gen_cfg, max_rows=B)

    for start, B, g in it:
        alone = B == 1 and one_at_a_time
        group = [prompts[start]] if alone else prompts if cfg.continuous else prompts[start:start + B]
        uid = group[0]["id"] if alone else f"batch{B}{'c' if cfg.continuous else ''}:" + "+".join(str(p["id"]) for p in group)
        ids = target.encode_prompt(group[0]["prompt"]) if alone else [target.encode_prompt(p["prompt"]) for p in group]
        gen_cfg = cfg.generation(seed=cfg.seed + (start if alone else g))
        methods = order if alone else batched
        for rep in range(cfg.repeats):
            if all((uid, m, rep) in done for m in methods):
                continue
            k = ((start if alone else g) * cfg.repeats + rep) % len(methods)
            results = {m: generate(m, ids, gen_cfg, B) for m in methods[k:] + methods[:k]}
            ar = results["ar"] if ("ar" in results and greedy) else None
            new = [dict(_row(results[m], group[0], m, ar) if alone else _batch_row(results[m], uid, m, ar, B), repeat=rep)
                   for m in methods]
            rows = _append_rows(partial, key, rows, new)
    return rows


def _result(cfg: BenchConfig, key, target, runners: dict, skipped, rows: list, order: list, batched: list, sizes: list,
            read_gbs: float, load: dict) -> dict:
    """The result file's dict: the aggregates per batch size, the machine, the drafters, how it was counted."""
    greedy = cfg.temperature == 0.0
    by_batch = {str(B): {"methods": aggregate(fastest_pass([r for r in rows if r.get("batch_size") == B]), batched,
                                              greedy)} for B in sizes}
    single = [r for r in rows if "batch_size" not in r]
    if single:
        by_batch = {"1": {"methods": aggregate(fastest_pass(single), order, greedy)}, **by_batch}
    result = {"config": asdict(cfg), "config_key": key,
              "machine": {**machine_info(target), "memory_read_gbs": round(read_gbs, 2)},
              "drafters": {m: r.config() for m, r in runners.items()},
              "skipped": skipped,
              "aggregation": ("each (prompt, method) counted by the fastest of its "
                              f"{cfg.repeats} passes; " if cfg.repeats > 1 else "") +
                             "tokens_per_s = sum(new_tokens)/sum(prefill+decode seconds) over prompts; "
                             "speedup_vs_ar = tokens_per_s / AR tokens_per_s on the same prompts; "
                             "speedup_vs_ar_median = median over prompts of the per-prompt ratio; "
                             "tau = emitted tokens / verify steps (bonus included)",
              "machine_load": load,
              "methods": by_batch[str(cfg.batch_sizes[0])]["methods"], "per_prompt": rows}
    if len(cfg.batch_sizes) > 1 or cfg.batch_sizes[0] > 1:
        result["by_batch"] = by_batch
        result["aggregation"] += ("; batches: " + ("continuous batching, B rows at once over all prompts (a finished"
                                  " row's place to the next prompt)" if cfg.continuous else
                                  "the prompts in consecutive groups of B decoded together") + ", tokens_per_s ="
                                  " every row's new tokens / the batch's wall time (prefill included), tau per row-step,"
                                  " verify_ms per batch step, match_ar = every row equals batched AR's row" +
                                  ("; batched steps eager (compiled: one request at a time only)"
                                   if getattr(target, "compile", False) else ""))
    ar_ms = (by_batch.get("1", {}).get("methods", {}).get("ar") or {}).get("verify_ms")
    if ar_ms:  # how close the one-token step is to reading the weights at the machine's read bandwidth
        read = target.dtype_report.get("int4", {}).get("step_weight_bytes") or weight_bytes(target.model)
        step_gbs = read / (ar_ms / 1e3) / 1e9
        result["step_vs_memory"] = {"ar_step_ms": round(ar_ms, 2), "weight_mb": round(read / 1e6, 1),
                                    "weight_read_gbs": round(step_gbs, 2), "memory_read_gbs": round(read_gbs, 2),
                                    "fraction_of_read_bandwidth": round(step_gbs / read_gbs, 3)}
    if cfg.repeats > 1:
        result["methods_first_pass"] = aggregate([r for r in single if r.get("repeat", 0) == 0], order, greedy)
    return result


def _runners(cfg: BenchConfig, target) -> tuple[dict, dict]:
    """({method: why it cannot run here}, {method: Runner} for the others, heavy objects shared)."""
    skipped = {m: why for m in cfg.methods if (why := unavailable_reason(m, target))}
    for m, why in skipped.items():
        print(f"bench: {m} skipped: {why}", file=sys.stderr)
    shared: dict = {}
    return skipped, {m: make_runner(m, target, cfg.options, shared) for m in cfg.methods if m not in skipped}


def _writable(out: Path) -> Path:
    """`out` once its folder exists and is writable, else a one-line DartLabError."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DartLabError(f"cannot create output folder {out.parent}: {e.strerror}") from None
    if not os.access(out.parent, os.W_OK):
        raise DartLabError(f"output folder {out.parent} is not writable")
    return out


def _read_partial(partial: Path, key: str) -> list[dict]:
    """The rows an interrupted run of the same configuration (`key`) left in `partial`."""
    rows = []
    if partial.is_file():
        for line in partial.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interruption
            if rec.get("config_key") == key:
                rows.append(rec["row"])
    return rows


def _append_rows(partial: Path, key: str, rows: list[dict], new_rows: list[dict]) -> list[dict]:
    """One pass of one prompt (or batch group) by every method: appended to `partial` and synced before it
    counts (an interrupted bench resumes after it), replacing that pass's older rows in `rows`."""
    with open(partial, "a") as f:
        for r in new_rows:
            f.write(json.dumps({"config_key": key, "row": r}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    done = {(r["prompt_id"], r.get("repeat", 0)) for r in new_rows}
    return [r for r in rows if (r["prompt_id"], r.get("repeat", 0)) not in done] + new_rows
