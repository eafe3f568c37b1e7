"""The tree budget theta, chosen from measured cost (beyond the paper: the released code fixes 60).

    expected speed(theta) = tau(theta) / (t_verify(theta + 1) + t_draft + t_search)   [tokens / ms]
    AR speed              = 1 / t_verify(1)

t_verify(N) is measured once per target, device, dtype, runner and machine (`cost_curve`, cached on
disk with that fingerprint), after a short and a long committed context; a request prices its trees
at its own context length (`curve_at`: the attention over the cache makes every node dearer there).
tau(theta) -- tokens per step with a tree of theta drafted nodes -- comes from ONE decode at the widest
budget: both tree builders take nodes in rank order (`tree.best_closed_tree`), so the tree of any
smaller budget is exactly the nodes of rank < theta, and at T=0 the path it
would have accepted is the prefix of the accepted path whose ranks are < theta
(`acceptance_profile`). The runner takes the theta with the best expected speed, or plain AR steps
when no theta beats AR (and says so), and keeps updating tau from the steps it decodes.
On a GPU t_verify is nearly flat in N and theta comes out large; on a 2-core CPU it does not.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .engine import q4
from .engine import kernels
from .assets import cache_dir
from .atomic import write_json
from .machine import LoadMeter
from .smoke import pick
from .target import sync
from .tree import Tree

DRAFTING_REVISION = 1  # part of every calibration's key: raise it when the drafters' or the search's cost changes, so
# a cached calibration priced on the old code is measured again (the target's cost has `runner_revision`)

# short generic requests, none from a benchmark set: the calibration decode must not see test prompts
CALIBRATION_PROMPTS = ("Explain how a refrigerator keeps food cold.",
                       "Write a short story about a lighthouse keeper.",
                       "What are the pros and cons of remote work?")


@dataclass(frozen=True)
class BudgetConfig:
    sizes: tuple = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # verify sizes measured (nodes incl. the root)
    repeats: int = 7  # timed verifies per size (median)
    prompt_len: int = 128  # committed context during the timing
    long_prompt_len: int = 1024  # the curve is timed again after this many tokens: attention grows with the
    # context, per node, while one node's cost hardly moves (experiments/engine/verify_latency.py,
    # docs/speed.md), so a tree priced at 128 tokens is too big for a long prompt (`curve_at`)
    max_nodes: int = 63  # widest tree probed in the calibration decode (drafted nodes)
    small_nodes: int = 4  # a second, small budget decoded in the calibration: drafting + search cost
    # depends on theta (DART: fewer MASK positions, a smaller beam; about half at theta 2-4 of what it is
    # at 16-63, experiments/engine/draft_cost_by_theta.py), so small trees' cost is measured, not scaled
    calibration_tokens: int = 48  # per calibration prompt
    calibration_warmup_tokens: int = 8  # an untimed decode at the widest budget before the timed ones: a first
    # call's one-off costs (a kernel built or loaded, tables made on first use) would otherwise be priced as
    # drafting and cached with the calibration
    refresh_ratio: float = 1.3  # observed / predicted verify time (median over a generation) that re-measures the curve
    refresh_min_steps: int = 8  # steps a generation needs before it can trigger a refresh
    refresh_streak: int = 2  # consecutive generations off by refresh_ratio (same side) before re-measuring: one
    # slow generation is often a passing host hiccup, and a curve re-measured inside it sticks (every size
    # read slow, and a whole dataset drafted trees sized for that moment: docs/speed.md)
    refresh_repeats: int = 5  # timed verifies per size when re-measuring
    cost_measurements: int = pick(3, 1)  # a cached curve is measured again at its next loads until this many
    # measurements were merged (per-size minimum): one measurement taken in a slow moment of the host would
    # otherwise stick (a small tree priced far above what its steps then cost, theta too small for a whole run).
    # Smoke runs (DART_LAB_SMOKE: CI's notebooks) merge one: their cells check the choice against the curve it
    # was made on, whatever the curve reads, and each process after the first would time it again
    overhead_memory: int = 512  # steps a per-theta mean of drafting + search time remembers (it follows the machine)
    sampled_min_steps: int = 128  # sampled steps covering a rank before its sampled acceptance rate is used (fewer: one
    # short answer decided it, and a pessimistic rate can send sampling to AR fallback, which then sees no drafts)
    batch_sizes: tuple = (1, 2, 4, 8, 16, 32, 64)  # live-row counts at which batched verify cost is timed (between
    # them it is interpolated); a batch times the ones up to its own size, when it first runs
    observed_min_steps: int = 8  # decoded batched steps of one (rows, nodes) shape before their median replaces the
    # timed surface there (`observed_curve`): the timing loop's readings of one shape wander by a third between
    # measurements on a small VM, while hundreds of decoded steps pin it down
    observed_memory: int = 256  # decoded steps remembered per shape (the newest: it follows the machine)
    batch_max_tokens: int = 512  # batched verify timed up to this many nodes in all (rows x nodes): wider batched
    # trees are priced by proportional growth (`interpolate`), which on a CPU already rules them out
    fallback_probe_every: int = 4  # while a runner is in AR fallback, every this many generations one decodes with
    # the best tree anyway (when the drafter learns theta in that mode): a fallback drafts no tree, so without a
    # probe no evidence could bring theta back (seen at T=1: dart-ctx on Alpaca fell back after two prompts and
    # stayed, tau 1.08, where dart at theta 4-5 kept 1.01x AR)
    fallback_probe_steps: int = 32  # a probe drafts trees for its first this many steps, then runs what the
    # fallback runs (`methods.Probe`): enough steps to show the acceptance by rank, without a whole answer of trees
    # expected to lose (a 128-token probe at 0.75-0.93x AR, every fourth answer, cost DART 3-5 % where its trees
    # never paid)
    batch_resume_gain: float = 1.1  # a batch whose widest step fell back to AR turns trees on as rows finish only
    # where one is expected to gain this much: the head first catches up on every position since the prompt (not
    # priced), and trees at the last 1-2 rows sit near break-even (measured at 4 rows: 0.976x AR turning them on,
    # 1.007x keeping AR; docs/LOG.md)


def calibration_key(cfg: BudgetConfig) -> dict:
    """The fields a calibration decode depends on (the rest steer the runner afterwards)."""
    return {k: getattr(cfg, k) for k in ("sizes", "repeats", "prompt_len", "max_nodes", "small_nodes",
                                         "calibration_tokens", "calibration_warmup_tokens")}


def cpu_name() -> str:
    """The CPU model (Linux /proc/cpuinfo), else what `platform` knows."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def fingerprint(target) -> dict:
    """What the verify cost depends on; the cache key of a cost curve."""
    cpu = cpu_name()
    dev = target.device
    if dev.type == "cuda":
        cpu = torch.cuda.get_device_name(dev)
    return {"device": str(dev.type), "hardware": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "target": target.name, "layers": target.num_layers,
            "hidden": target.hidden_size, "dtype": getattr(target, "precision", str(target.dtype)), "runner": getattr(target, "runner", "hf"),
            "packed_weights": getattr(target, "packs_weights", False),
            "attention_dtype": str(getattr(target, "attention_dtype", target.dtype)),
            "cache_dtype": str(getattr(target, "cache_dtype", target.dtype)),
            "attention_kernel_nodes": getattr(target, "attention_nodes", 0),  # steps on our kernel (attention.py)
            "norm_kernel": kernels.rms_norm_here() if getattr(target, "runner", "hf") == "fast" else False,
            "kernel_isa": kernels.isa(),  # which build of our kernels runs (AVX-512 or AVX2: csrc/vec.h)
            "runner_revision": getattr(target, "runner_revision", 0),  # a cheaper runner re-measures its curve
            "compiled": ({"node_buckets": list(target.node_buckets), "key_bucket": target.key_bucket}
                         if getattr(target, "compile", False) else False),
            **({"int4_revision": target.int4_revision, "int4_paths": target.int4_paths, "q4_kernel": q4.available()}
               if getattr(target, "precision", None) == "int4" else {})}


@torch.no_grad()
def measure_verify(target, sizes, repeats: int = 7, prompt_len: int = 128) -> dict[int, float]:
    """Median wall ms of one verify of an N-node tree (see `verify_samples`)."""
    return {n: statistics.median(ts) for n, ts in verify_samples(target, sizes, repeats, prompt_len).items()}


def verify_samples(target, sizes, repeats: int = 7, prompt_len: int = 128) -> dict[int, list[float]]:
    """Wall ms of `repeats` verifies of an N-node tree (a chain; cost depends on N, not on shape)
    after `prompt_len` committed tokens, each size measured interleaved with the others, after one
    untimed warm-up round."""
    return _time_chains(target, [prompt_len], sizes, repeats, lambda prompts: target.prefill(prompts[0]),
                        lambda trees: target.verify(trees[0]), lambda: target.commit([0]), target.truncate)


def _time_chains(target, rows: list[int], sizes, repeats: int, prefill, verify, commit, truncate) -> dict[int, list]:
    """The timing loop of `verify_samples` and `batch_verify_ms`: `rows` prompts of random ids (lengths
    given, passed to `prefill` as a list), then per round and size one N-node chain per row verified (timed; round 0 warms up), its root
    committed and the cache cut back."""
    g = torch.Generator().manual_seed(0)
    V = min(target.vocab_size, 1000)
    prompts = [torch.randint(3, V, (n,), generator=g) for n in rows]
    prefill(prompts)
    times = {n: [] for n in sizes}
    for r in range(repeats + 1):  # round 0 warms up
        for n in sizes:
            trees = [Tree(torch.randint(3, V, (n,), generator=g), torch.arange(-1, n - 1)) for _ in rows]
            sync(target.device)
            t = time.perf_counter()
            verify(trees)
            sync(target.device)
            if r:
                times[n].append((time.perf_counter() - t) * 1e3)
            commit()
            truncate(rows[0])
    return times


def cost_file(prefix: str, key) -> Path:
    """A cached measurement's file: cost/<prefix><16 hex digits of the key> under the cache directory."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "cost" / f"{prefix}{digest}.json"


def read_quiet(path: Path) -> dict | None:
    """The cached measurement at `path` when it records a quiet machine; None (measure again) when it is
    missing, unreadable, or was measured while other work used the cores or before loads were recorded."""
    try:
        d = json.loads(path.read_text())
        return d if d["machine_load"] and not d["machine_load"]["contended"] else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The curve made non-decreasing in N, without letting one noisy size move the others. A bigger tree
    cannot cost less, but readings are noisy both ways (a small size read above a bigger one; the widest
    tree read low, and a running minimum from the widest down would then set every size, and the
    per-token context growth of every size, to that reading). So: 1. a size that breaks the
    order with a neighbour while its two neighbours agree with each other is a lone outlier and takes
    that neighbour's value (an interior one first, from the readings; then the smallest size is lowered
    to its neighbour when above it, the widest raised to its neighbour when below it); 2. what still
    decreases is pooled into its mean (pool-adjacent-violators: the least-squares non-decreasing fit).
    A clean rising curve is unchanged, and one far-off reading moves no other size."""
    ns = sorted(curve)
    raw = [float(curve[n]) for n in ns]
    v = list(raw)
    lone = {i for i in range(1, len(v) - 1) if raw[i - 1] <= raw[i + 1] and not raw[i - 1] <= raw[i] <= raw[i + 1]}
    lone -= {j for i in lone for j in (i, i + 1) if i + 1 in lone}  # two neighbours out of order: no lone one
    for i in lone:
        v[i] = raw[i - 1] if raw[i] < raw[i - 1] else raw[i + 1]
    if len(v) >= 3:
        v[0] = min(v[0], v[1])
        v[-1] = max(v[-1], v[-2])
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for x in v:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s_, c = blocks.pop()
            blocks[-1][0] += s_
            blocks[-1][1] += c
    out = [b[0] / b[1] for b in blocks for _ in range(b[1])]
    return dict(zip(ns, out))


def cost_curve(target, cfg: BudgetConfig = BudgetConfig(), cache: bool = True, refresh: bool = False) -> dict:
    """{"fingerprint", "verify_ms": {N: ms} after cfg.prompt_len committed tokens,
    "context_ms_per_token": {N: ms} the growth per committed token beyond that (from a second timing
    after cfg.long_prompt_len tokens; `curve_at`)} for this target and machine, measured and cached;
    both made non-decreasing in N (`monotone`). A cached curve is measured again at each load until
    `cfg.cost_measurements` measurements are merged, keeping each size's fastest reading (the host's
    slow moments only ever add time). A measurement taken while other processes kept the cores busy
    (`machine.LoadMeter`) is used for this call only, never cached; a cached one carries its machine
    load and time (`age_s`). refresh=True measures again and replaces the cached curve (`dart-lab
    calibrate --refresh`)."""
    fp = fingerprint(target)
    # the long timing must fit the target's context (a small test model's may be 512 tokens)
    lens = {"short": cfg.prompt_len, "long": max(min(cfg.long_prompt_len, target.max_context - max(cfg.sizes) - 1),
                                                 cfg.prompt_len)}
    path = cost_file("", [fp, [cfg.sizes, cfg.repeats, cfg.prompt_len, lens["long"]]])
    saved, count, saved_meta = None, 0, {}
    if cache and path.is_file():
        try:
            d = json.loads(path.read_text())
            saved = {c: {int(k): float(v) for k, v in d["raw_verify_ms"][c].items()} for c in lens}
            count = int(d["measurements"])
            saved_meta = {k: d.get(k) for k in ("machine_load", "measured_at")}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            saved, count = None, 0
    load, measured_at = saved_meta.get("machine_load"), saved_meta.get("measured_at")
    if refresh or saved is None or count < cfg.cost_measurements:
        with LoadMeter() as meter:  # a line per context: the first measurement on a machine takes a while
            raw = {}
            for c, n in lens.items():
                say(f"timing verifies of {min(cfg.sizes)}-{max(cfg.sizes)} nodes after {n} tokens "
                     f"(measurement {count + 1} of {cfg.cost_measurements}, cached)")
                raw[c] = measure_verify(target, cfg.sizes, cfg.repeats, n)
        load, measured_at, fresh = meter.load, time.time(), True
        if load["contended"]:  # other work on the cores bends the curve: used for this run only, never cached
            saved, count = raw, 0
        else:
            if saved is not None and not refresh and all(set(saved[c]) == set(raw[c]) for c in lens):
                raw = {c: {n: min(raw[c][n], saved[c][n]) for n in raw[c]} for c in lens}
            saved, count = raw, (1 if refresh else count + 1)
            if cache:
                write_json(path, {"fingerprint": fp, "raw_verify_ms": raw, "prompt_lens": lens, "measurements": count,
                                  "machine_load": load, "measured_at": measured_at})
    else:
        fresh = False
    short = monotone(saved["short"])
    long = monotone({n: max(v, short[n]) for n, v in saved["long"].items()})
    per_token = monotone({n: (long[n] - short[n]) / max(lens["long"] - lens["short"], 1) for n in short})
    if fp["compiled"]:  # a compiled step runs its nodes padded to the next bucket: price it there
        short, per_token = (padded(c, fp["compiled"]["node_buckets"]) for c in (short, per_token))
    return {"fingerprint": fp, "verify_ms": short, "context_ms_per_token": per_token,
            "prompt_len": cfg.prompt_len, "measurements": count, "cached": not fresh,
            "contended": bool(load and load.get("contended")), "machine_load": load,
            "age_s": round(time.time() - measured_at, 1) if measured_at else None}


def padded(curve: dict[int, float], buckets) -> dict[int, float]:
    """The curve of a runner that pads each step's nodes to the next of `buckets` (compiled steps,
    `runner.FastTarget.node_buckets`): every size from 1 to the widest measured, each at its bucket's
    cost (beyond the last bucket, where steps run eager, as measured). Interpolating between measured
    buckets instead priced 3 nodes between 2 and 4 although they run as 4, and drafted trees that lost."""
    widest = max(curve)  # measured there, it ran padded too: its reading is its bucket's cost
    return {n: interpolate(curve, min(next((b for b in sorted(buckets) if b >= n), n), widest))
            for n in range(1, widest + 1)}


def say(line: str) -> None:
    """A progress line for measurements that take seconds to minutes (stderr: a bench's JSON stays clean)."""
    print(f"[dart_lab] {line}", file=sys.stderr, flush=True)


def curve_at(cost: dict, context: int) -> dict[int, float]:
    """The verify curve {N: ms} after `context` committed tokens: the short-context curve plus each
    size's growth per token beyond its context (linear: attention reads every cached key once per node;
    none below it). A cost dict without the growth (made by hand) is its own curve at any context."""
    per_token = cost.get("context_ms_per_token")
    extra = max(context - cost.get("prompt_len", 0), 0)
    if not per_token or not extra:
        return cost["verify_ms"]
    return {n: ms + per_token.get(n, 0.0) * extra for n, ms in cost["verify_ms"].items()}


def interpolate(curve: dict[int, float], n: int) -> float:
    """Verify ms at n nodes, linear between measured sizes (flat beyond the ends)."""
    xs = sorted(curve)
    if n <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return curve[a] + (curve[b] - curve[a]) * (n - a) / (b - a)
    return curve[xs[-1]] * n / xs[-1]  # beyond the widest measured tree: grow proportionally


def expected_copy_tokens(p: float, L: int) -> float:
    """Tokens a step verifying a copy chain of L tokens alone emits on average, each copy token kept
    with probability p given its predecessors: 1 (the bonus) + p + p^2 + ... + p^L."""
    return 1.0 + sum(float(p) ** i for i in range(1, L + 1))


def copy_cap(offers: list[tuple[list[int], float]], verify_ms: dict[int, float]) -> int:
    """A step without a tree (theta 0) that may still verify copies: how many tokens of each row's copy
    chain to verify. Every row's chain is cut to one cap L (the rows of a batch share the step's width),
    chosen for the most expected tokens per ms,
        sum_b E(p_b, min(L_b, L)) / t(L + 1)      (L = 0: a plain AR step for every row),
    offers: per row (chain, p = the chance each copy token is kept); verify_ms: the step's cost by nodes
    per row (the batch's curve at this many rows; one row: the batch-1 curve)."""
    widest = max((len(c) for c, _ in offers), default=0)
    # gained[L]: sum_b (E(p_b, min(L_b, L)) - 1), each row's terms p_b^i added once (a step prices every cap)
    gained = [0.0] * (widest + 1)
    for chain, p in offers:
        term, acc = 1.0, 0.0
        for L in range(1, widest + 1):
            if L <= len(chain):
                term *= float(p)
                acc += term
            gained[L] += acc
    best, best_rate = 0, len(offers) / interpolate(verify_ms, 1)
    for L in range(1, widest + 1):
        rate = (len(offers) + gained[L]) / interpolate(verify_ms, L + 1)
        if rate > best_rate:
            best, best_rate = L, rate
    return best


def acceptance_profile(steps: list[dict], max_nodes: int) -> list[float]:
    """tau(theta) for theta = 0..max_nodes from decode steps that recorded `path_ranks` (T=0): a step
    emits 1 + (accepted nodes of rank < theta) tokens with a budget of theta."""
    ranked = [s["path_ranks"] for s in steps if "path_ranks" in s]
    if not ranked:
        return [1.0] * (max_nodes + 1)
    return [1.0 + sum(sum(1 for r in rs if r < th) for rs in ranked) / len(ranked) for th in range(max_nodes + 1)]


def overhead_at(means: dict[int, float], theta: int, scale=None) -> float:
    """Drafting + search ms per step at budget `theta` from the per-theta means measured so far
    (`means`: theta -> ms), following the drafter's cost shape scale(theta) (`draft_cost_scale`:
    EAGLE-3's head forwards grow with the tree's depth up to its depth limit, DART's one forward does
    not). Between two measured budgets a and b: the same fraction of the way from a's cost to b's as
    scale(theta) is from scale(a) to scale(b) (linear in theta where the shape is flat: EAGLE-3 at
    theta 10 already runs all 8 forwards of theta 63, where a line from theta 4 to theta 63 would price
    it near theta 4); beyond them: the nearest one times scale(theta) / scale(nearest)."""
    xs = sorted(means)
    if not xs:
        return 0.0
    s = scale or (lambda th: 1.0)
    for a, b in zip(xs, xs[1:]):
        if a <= theta <= b:
            span = s(b) - s(a)
            frac = (s(theta) - s(a)) / span if abs(span) > 1e-9 else (theta - a) / (b - a)
            return means[a] + (means[b] - means[a]) * min(max(frac, 0.0), 1.0)
    near = xs[0] if theta < xs[0] else xs[-1]
    return means[near] * s(theta) / max(s(near), 1e-9)


def choose_budget(tau: list[float], verify_ms: dict[int, float], overhead_ms) -> dict:
    """The theta with the best expected speed; theta 0 (plain AR steps) when none beats AR.
    overhead_ms: drafting + search ms per step, a number (every theta alike) or a function of theta."""
    ar = 1.0 / interpolate(verify_ms, 1)
    over = [0.0] + [overhead_ms(th) if callable(overhead_ms) else overhead_ms for th in range(1, len(tau))]
    speed = [ar] + [tau[th] / (interpolate(verify_ms, th + 1) + over[th]) for th in range(1, len(tau))]
    best = max(range(len(speed)), key=lambda th: (speed[th], -th))
    return {"theta": best, "expected_speedup_vs_ar": speed[best] / ar,
            "expected_speedup_by_theta": [round(v / ar, 4) for v in speed],
            "overhead_ms": over[best],
            "overhead_ms_by_theta": [round(v, 3) for v in over[1:]],
            "fallback_to_ar": best == 0}


@torch.no_grad()
def batch_verify_ms(target, batch: int, sizes, repeats: int = 5, prompt_len: int = 128) -> dict[int, float]:
    """Median wall ms of one batched verify (`batch.BatchTarget`) of `batch` rows with an N-node chain
    each, after `prompt_len` committed tokens per row, sizes interleaved after a warm-up round."""
    from .engine.batch import BatchTarget

    bt = BatchTarget(target)
    times = _time_chains(target, [prompt_len] * batch, sizes, repeats, bt.prefill, bt.verify,
                         lambda: bt.commit([[0]] * batch), bt.truncate)
    return {n: statistics.median(ts) for n, ts in times.items()}


def batch_cost_curve(target, batch: int, cfg: BudgetConfig = BudgetConfig(), cache: bool = True) -> dict[int, float]:
    """{N: ms} of one step verifying `batch` rows of N nodes each (the surface t(B, N) at one B), timed at
    the sizes of `cfg.sizes` with batch x N <= cfg.batch_max_tokens, cached per machine like `cost_curve`
    (with its machine load and time; a file without them is measured again); non-decreasing in N (`monotone`)."""
    sizes = [n for n in cfg.sizes if n == 1 or batch * n <= cfg.batch_max_tokens]
    fp = fingerprint(target)
    path = cost_file("batch_", [fp, batch, sizes, cfg.refresh_repeats, cfg.prompt_len])
    d = read_quiet(path) if cache else None  # served only when it records a quiet machine
    if d is not None:
        try:
            return monotone({int(k): float(v) for k, v in d["verify_ms"].items()})
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    with LoadMeter() as meter:
        say(f"timing batched verifies of {batch} rows x {min(sizes)}-{max(sizes)} nodes (cached)")
        curve = batch_verify_ms(target, batch, sizes, cfg.refresh_repeats, cfg.prompt_len)
    if cache and not meter.load["contended"]:  # a contended measurement serves this run only
        write_json(path, {"fingerprint": fp, "batch": batch, "verify_ms": curve, "machine_load": meter.load,
                          "measured_at": time.time()})
    return monotone(curve)


def interpolate_batch(curves: dict[int, dict[int, float]], rows: int) -> dict[int, float]:
    """The verify curve {N: ms} at `rows` live rows, linear between the two measured batch sizes around it
    (`curves`: batch size -> curve; beyond the largest: proportional to the rows)."""
    bs = sorted(curves)
    lo = max((b for b in bs if b <= rows), default=bs[0])
    hi = min((b for b in bs if b >= rows), default=bs[-1])
    ns = sorted(set(curves[lo]) & set(curves[hi]))
    if lo == hi:
        scale = rows / lo if rows > lo else 1.0
        return {n: curves[lo][n] * scale for n in ns}
    f = (rows - lo) / (hi - lo)
    return {n: curves[lo][n] + f * (curves[hi][n] - curves[lo][n]) for n in ns}


ONE_SEQUENCE = 0  # `step_log`'s row count for the steps of `generate.generate` (one sequence, its own runner)


def _step_kind(target, rows: int) -> tuple:
    """`step_log`'s key for steps of `rows` rows (ONE_SEQUENCE: the single-sequence loop) without the nodes:
    the arithmetic and compilation too (another dtype is another machine)."""
    return (target.precision, bool(getattr(target, "compile", False)), rows)


def log_step(target, rows: int, nodes: int, ms: float, context: int,
             memory: int = BudgetConfig.observed_memory) -> None:
    """Record one decoded step on the target's `step_log`: `rows` live rows of a batch (or ONE_SEQUENCE),
    `nodes` per row after padding, `context` cached positions it attended over, `ms` what it took."""
    log = target.step_log.setdefault(_step_kind(target, rows) + (nodes,), [])
    log.append((ms, context))
    del log[:-memory]


def observed_curve(target, rows: int, curve: dict[int, float], min_steps: int, at) -> dict[int, float]:
    """The verify curve `curve` (at `rows` live rows, or ONE_SEQUENCE; at the context it is wanted for) checked
    against the steps of that kind decoded on this target (any method: AR's steps price the trees of the
    methods after it). Each step is compared with the timed curve at the context it ran at (`at`: context ->
    that curve), so steps of other lengths price this context. A shape decoded at least `min_steps` times
    takes `curve` x the median of those ratios; every other size is scaled by the median over those shapes,
    so the curve keeps one level (a decoded one-token step beside timed trees of another moment would
    misprice every tree); then non-decreasing (`monotone`).
    Why: a timing loop verifies back to back, rows of one length, the root kept; decoded, a step also pays
    its accept and its paths' cache compaction, and a cached curve was timed at another moment of the machine.
    Priced by the loop alone, batches and single requests drafted trees that lost (docs/speed.md)."""
    kind = _step_kind(target, rows)
    # `at` hands back one curve for nearby contexts: each (curve, nodes) interpolated once; the curve is kept
    # beside its value, so its id cannot pass to another curve while this runs
    timed: dict = {}

    def at_step(ctx: int, n: int) -> float:
        c = at(ctx)
        if (id(c), n) not in timed:
            timed[id(c), n] = (interpolate(c, n), c)
        return timed[id(c), n][0]

    seen = {n: interpolate(curve, n) * statistics.median(ms / at_step(ctx, n) for ms, ctx in log)
            for (*k, n), log in target.step_log.items() if tuple(k) == kind and len(log) >= min_steps}
    if not seen:
        return curve
    scale = statistics.median(ms / interpolate(curve, n) for n, ms in seen.items())
    return monotone({**{n: ms * scale for n, ms in curve.items()}, **seen})


# ----------------------------------------------------------------------------- the controller
@dataclass
class Observations:
    """What a runner's budget has seen. greedy / sampled: (budget, path_ranks) of every tree step at
    T=0 / T>0 (the rank of each accepted node; tau(theta) comes from them); overhead: theta ->
    [drafting + search ms summed, steps], decayed so that it follows the machine."""

    greedy: list = field(default_factory=list)
    sampled: list = field(default_factory=list)
    overhead: dict = field(default_factory=dict)


class BudgetController:
    """The automatic tree budget of one drafter on one target (paper Sec. 4's node budget, chosen from
    measured cost): calibrates once when built (cost curve + a decode of the calibration prompts at the
    widest and at a small budget, both cached per machine and drafter), chooses theta for each request's
    context (`plan`; theta 0 = AR fallback, with a probe every few generations), learns from every
    generation (`learn`: acceptance per rank, drafting cost per theta, re-measuring the cost curve when
    the machine's speed moved), and prices batches (`batch_policy`)."""

    def __init__(self, target, drafter, cfg: BudgetConfig = BudgetConfig(), refresh: bool = False,
                 new_drafter=None, calibrate: bool = True):
        self.target, self.drafter, self.cfg, self.new_drafter = target, drafter, cfg, new_drafter
        self.observed = Observations()
        self.budget: dict | None = None  # greedy decoding's theta (and sampling's: budget_sampled)
        self.budget_sampled: dict | None = None
        self.cost: dict = {}
        self.batch_costs: dict[int, dict[int, float]] = {}  # batch size -> verify ms by nodes per row
        self.head_ms: dict[int, float] = {}  # rows -> ms of one batched DART head forward (head_batch_ms)
        self._curves: dict = {}  # context // 16 -> curve_at there, and the cost curve they are of (`_curve_at`)
        self.off_streak = 0  # consecutive generations whose verify times disagreed with the curve (signed)
        self.fallback_runs = {False: 0, True: 0}  # generations in AR fallback, per mode (sampled or not)
        if calibrate:
            self.calibrate(refresh)

    # -- calibration
    def calibrate(self, refresh: bool = False) -> None:
        """Cost curve (cached per machine) and a decode of the calibration prompts at the widest budget
        (its path ranks give tau(theta) for every theta) and at a small one (drafting + search cost
        at both ends), cached per drafter: head weights, n-gram, search settings, target and dtype.
        refresh: measure both again instead of reading the caches (`dart-lab calibrate --refresh`)."""
        from .config import GenerationConfig
        from .generate import generate

        cfg, t = self.cfg, self.target
        self.cost = cost_curve(t, cfg, refresh=refresh)
        key = {"drafter": drafter_key(self.drafter), "weights": weights_digest(self.drafter), "target": t.name,
               "dtype": t.precision, "budget": calibration_key(cfg), "prompts": CALIBRATION_PROMPTS,
               "machine": self.cost["fingerprint"], "drafting_revision": DRAFTING_REVISION}  # drafting time depends
        # on the machine, the runner and the drafting code
        path = cache_dir() / "calibration" / (hashlib.sha256(json.dumps(key, sort_keys=True, default=str)
                                                              .encode()).hexdigest()[:16] + ".json")
        try:
            if refresh:
                raise OSError("measure again")
            saved = json.loads(path.read_text())
            self.observed = Observations([tuple(x) for x in saved["observed"]], [],
                                         {int(k): v for k, v in saved["overhead_obs"].items()})
        except (OSError, ValueError, KeyError):
            self.observed = Observations()

            def decode(text: str, budget: int, tokens: int):
                self.drafter.set_budget(budget)
                ids = t.encode_prompt(text) if t.tokenizer is not None else \
                    torch.randint(3, t.vocab_size, (16,), generator=torch.Generator().manual_seed(len(text)))
                return generate(t, ids, self.drafter, GenerationConfig(max_new_tokens=tokens))

            with LoadMeter() as meter:
                # untimed first: a first call's one-off costs (a kernel built or loaded) are not drafting
                decode(CALIBRATION_PROMPTS[0], cfg.max_nodes, cfg.calibration_warmup_tokens)
                for budget in (cfg.max_nodes, cfg.small_nodes):  # ranks from the widest; the cost of a small tree too
                    say(f"calibrating {self.drafter.name}: {len(CALIBRATION_PROMPTS)} prompts x "
                         f"{cfg.calibration_tokens} tokens at {budget} nodes (cached)")
                    for text in CALIBRATION_PROMPTS:
                        self.observe(decode(text, budget, cfg.calibration_tokens), budget)
            if not meter.load["contended"]:  # drafting times of a busy moment serve this run only
                write_json(path, {"observed": self.observed.greedy, "overhead_obs": self.observed.overhead,
                                  "machine_load": meter.load, "measured_at": time.time()})
        self.choose()

    # -- one request
    def plan(self, prompt_len: int, sampled: bool, max_new_tokens: int) -> tuple[dict, dict[int, float]]:
        """(budget, verify curve) for one request: theta re-chosen with every tree priced at the request's
        mean committed context (prompt + half the answer), the probe in AR fallback, put on the drafter."""
        if sampled and self.budget_sampled is None:  # sampling has its own theta, from its own acceptance
            self.choose(sampled=True)
        context = prompt_len + max_new_tokens // 2
        curve = observed_curve(self.target, ONE_SEQUENCE, curve_at(self.cost, context), self.cfg.observed_min_steps,
                               at=self._curve_at)
        budget = {**self.for_context(self.budget_sampled if sampled else self.budget, curve), "context": context}
        if budget["fallback_to_ar"] and self.learns(sampled):
            budget = self.probe(budget, sampled)
        self.apply(budget, curve)
        return budget, curve

    def _curve_at(self, context: int) -> dict[int, float]:
        """`curve_at` for a decoded step's context, to 16 positions (a few hundredths of a ms), kept until the
        cost curve changes."""
        if self._curves.get("cost") is not self.cost:
            self._curves = {"cost": self.cost}
        if context // 16 not in self._curves:
            self._curves[context // 16] = curve_at(self.cost, context // 16 * 16)
        return self._curves[context // 16]

    def learn(self, res, budget: dict, curve: dict[int, float], sampled: bool) -> None:
        """After a generation planned by `plan`: follow the machine, record what was accepted, choose again."""
        fallback = budget["fallback_to_ar"]
        refreshed = self.follow_machine(res, curve_at(self.cost, budget["context"]))  # the timed curve, not `curve`
        if not fallback:
            self.observe(res, budget["theta"], sampled, ranks=self.learns(sampled))
        if refreshed:  # a new cost curve: both thetas again
            self.choose()
        if refreshed or not fallback:
            self.choose(sampled)

    def follow_machine(self, res, curve: dict[int, float]) -> bool:
        """Keep the cost curve true to the machine as it is now. When the verify steps just decoded took
        `refresh_ratio` x longer (or shorter) than the curve predicts for their tree sizes (median over
        steps) in `refresh_streak` generations in a row, the curve is measured again (not cached) and
        theta is re-chosen. A busy machine changes the curve's shape, not only its scale -- one-token
        steps slow far more under contention than a tree verify of the same ops -- so a rescale would not do."""
        cfg = self.cfg
        obs = [(s["tree_size"], s["verify_ms"]) for s in res.steps if "tree_size" in s]
        if len(obs) < cfg.refresh_min_steps:
            return False
        ratio = statistics.median(ms / interpolate(curve, n) for n, ms in obs)  # curve: the request's context
        side = 1 if ratio > cfg.refresh_ratio else -1 if ratio < 1 / cfg.refresh_ratio else 0
        # count generations off the curve on the same side in a row (signed); a good one or a flip restarts
        self.off_streak = self.off_streak + side if side and self.off_streak * side > 0 else side
        if abs(self.off_streak) < cfg.refresh_streak:
            return False
        self.off_streak = 0
        self.cost = {**cost_curve(self.target, dataclasses.replace(cfg, repeats=cfg.refresh_repeats), cache=False),
                     "refreshes": self.cost.get("refreshes", 0) + 1, "refresh_trigger_ratio": round(ratio, 3)}
        return True

    def observe(self, res, budget: int, sampled: bool = False, ranks: bool = True) -> None:
        """Record a generation drafted with `budget`: its steps' path ranks (for tau(theta), unless
        ranks=False) and their drafting + search time (for the cost of that theta: every tree step,
        greedy or sampled -- the time does not depend on how the tree is accepted)."""
        if ranks:
            (self.observed.sampled if sampled else self.observed.greedy).extend(
                (budget, s["path_ranks"]) for s in res.steps if "path_ranks" in s)
        ms = [s["draft_ms"] + s["search_ms"] for s in res.steps if "path_ranks" in s and not s.get("copy_only")]
        if ms:
            tot, n = self.observed.overhead.get(budget, (0.0, 0))
            keep = min(1.0, self.cfg.overhead_memory / (n + len(ms)))  # forget old steps: follow the machine
            self.observed.overhead[budget] = [(tot + sum(ms)) * keep, (n + len(ms)) * keep]

    def overhead_ms(self, theta: int) -> float:
        """Expected drafting + search ms per step at budget `theta` (`overhead_at` over the per-theta
        means measured in the calibration and while decoding)."""
        means = {b: tot / n for b, (tot, n) in self.observed.overhead.items() if n > 0}
        return overhead_at(means, theta, lambda th: self.drafter.draft_cost_scale(th, self.cfg.max_nodes))

    @staticmethod
    def rank_rates(observed, probe: int, min_steps: int = 1) -> list[float | None]:
        """P(the rank-k node is accepted) for k < probe, each over the steps whose budget covered rank k
        (None where fewer than min_steps did)."""
        out = []
        for k in range(probe):
            rs = [r for b, r in observed if b > k]
            out.append(statistics.fmean(sum(1 for x in r if x == k) for r in rs) if len(rs) >= min_steps else None)
        return out

    def choose(self, sampled: bool = False) -> None:
        """Re-choose theta from everything observed: greedy decoding's, or (sampled=True) sampling's,
        where drafts are accepted less often and a smaller tree can pay better."""
        probe = self.cfg.max_nodes
        # tau(theta) = 1 + sum over k < theta of P(the rank-k node is accepted), each term over the
        # steps whose budget covered rank k. Why per term: after theta is chosen, only ranks < theta
        # get new (bench-prompt) steps; averaging whole sums per theta would mix two prompt
        # populations at the boundary and make tau(theta) jump and dip there, pulling theta toward
        # wherever it already is. Per-term estimates keep tau(theta) non-decreasing.
        # Sampling (T > 0): a rank's rate from the sampled steps once `sampled_min_steps` of them
        # covered it, else the greedy rate scaled by what the covered ranks show (sampled over greedy
        # acceptance, at most 1). Unscaled, the ranks beyond the current theta would keep greedy
        # decoding's rates and look far better than they are at T > 0 (docs/speed.md). With no covered
        # rank yet, the greedy rate as it is.
        rates = self.rank_rates(self.observed.greedy, probe)
        if sampled:
            own = self.rank_rates(self.observed.sampled, probe, self.cfg.sampled_min_steps)
            greedy = [r or 0.0 for r in rates]
            greedy_seen = sum(r for o, r in zip(own, greedy) if o is not None)
            scale = min(1.0, sum(o for o in own if o is not None) / greedy_seen) if greedy_seen > 0 else 1.0
            rates = [o if o is not None else r * scale for o, r in zip(own, greedy)]
        tau = [1.0]
        for r in rates:
            tau.append(tau[-1] + (r or 0.0))
        budget = {**choose_budget(tau, self.cost["verify_ms"], self.overhead_ms),
                  "tau_by_theta": [round(v, 4) for v in tau],
                  "steps_observed": len(self.observed.sampled if sampled else self.observed.greedy),
                  "verify_ms": self.cost["verify_ms"], "fingerprint": self.cost["fingerprint"],
                  "cost_refreshes": self.cost.get("refreshes", 0)}
        if sampled:
            self.budget_sampled = budget
        else:
            self.budget = budget
        self.apply(budget)

    def apply(self, budget: dict, curve: dict[int, float] | None = None) -> None:
        """Put `budget`'s theta (and the cost model behind it, `curve`: verify ms by tree size) on the drafter."""
        theta = budget["theta"]
        if theta:
            self.drafter.set_budget(theta)
            self.drafter.set_cost_model(curve or self.cost["verify_ms"], self.overhead_ms(theta),
                                        budget["tau_by_theta"])

    def for_context(self, budget: dict, curve: dict[int, float]) -> dict:
        """`budget` re-chosen for one request: the same tau(theta), each tree priced by the verify curve at
        the request's context length (`curve_at`; a long prompt makes every node dearer)."""
        if curve is self.cost["verify_ms"]:
            return budget
        return {**budget, **choose_budget(budget["tau_by_theta"], curve, self.overhead_ms)}

    def learns(self, sampled: bool) -> bool:
        """Does this drafter's theta follow the acceptance it observes in this mode (`Drafter.adapts_budget`)?"""
        return self.drafter.adapts_budget_sampled if sampled else self.drafter.adapts_budget

    def probe(self, budget: dict, sampled: bool) -> dict:
        """In AR fallback, every `fallback_probe_every`-th generation decodes with the best tree anyway
        (the theta of the highest expected speed): a fallback drafts no tree, so only a probe's steps can
        show that trees pay again (BudgetConfig.fallback_probe_every)."""
        self.fallback_runs[sampled] += 1
        if self.fallback_runs[sampled] % self.cfg.fallback_probe_every:
            return budget
        speed = budget["expected_speedup_by_theta"]
        theta = max(range(1, len(speed)), key=lambda th: (speed[th], -th))
        return {**budget, "theta": theta, "fallback_to_ar": False, "probe": True}

    # -- batches
    def batch_curve(self, rows: int) -> dict[int, float]:
        """Verify ms of one step over `rows` rows by nodes per row: the measured surface t(B, N)
        (`batch_cost_curve` at the batch sizes around `rows`), interpolated in B."""
        sizes = self.cfg.batch_sizes
        lo = max((b for b in sizes if b <= rows), default=sizes[0])
        hi = min((b for b in sizes if b >= rows), default=sizes[-1])
        for b in {lo, hi}:
            if b not in self.batch_costs:
                self.batch_costs[b] = batch_cost_curve(self.target, b, self.cfg)
        return interpolate_batch({b: self.batch_costs[b] for b in {lo, hi}}, rows)

    def head_batch_ms(self, rows: int, repeats: int = 5) -> dict[int, float] | None:
        """{1: ms, rows: ms} of one DART head forward for a single row and for `rows` rows together
        (`head_forward_ms`), timed here once per size; None for drafters without a batched head forward
        (EAGLE-3, pld, ...)."""
        from .drafters import DartDrafter

        if not isinstance(self.drafter, DartDrafter) or self.new_drafter is None:
            return None
        for n in {1, rows} - set(self.head_ms):
            self.head_ms[n] = head_forward_ms(self.new_drafter, self.target, n, repeats)
        return self.head_ms

    def batch_policy(self, prompts, sampled: bool, max_new_tokens: int, drafters, max_rows: int | None = None):
        """live rows -> (theta, verify curve): tau(theta) per row from the calibration, the step priced by
        the batched surface at that many rows (grown to the batch's mean context as the batch-1 curve
        grows; where batched steps of a shape were decoded on this target, what they took: `observed_curve`)
        plus every row's drafting + search, each row's tokens counted:
            expected speed(theta) = rows * tau(theta) / (t(rows, theta + 1) + rows * t_draft(theta)).
        Re-chosen whenever rows finish; theta 0 = batched AR steps, kept as rows finish unless a tree is expected to
        gain `batch_resume_gain` once the batch's widest step fell back. `policy.chosen`: rows -> the choice."""
        if sampled and self.budget_sampled is None:
            self.choose(sampled=True)
        tau = (self.budget_sampled if sampled else self.budget)["tau_by_theta"]
        for rows in range(1, min(max_rows or len(prompts), len(prompts)) + 1):  # timed now, not inside the decode
            self.batch_curve(rows)
            self.head_batch_ms(rows)
        context = statistics.fmean(len(p) for p in prompts) + max_new_tokens // 2

        def at(rows: int, ctx: int) -> dict[int, float]:
            """the timed surface at `rows`, grown to `ctx` cached positions as the batch-1 curve grows"""
            key = (rows, ctx // 16)
            if key not in at.memo:
                short, long = self.cost["verify_ms"], self._curve_at(ctx)
                grow = {n: long[n] / short[n] for n in short}
                at.memo[key] = {n: ms * interpolate(grow, n) for n, ms in self.batch_curve(rows).items()}
            return at.memo[key]

        at.memo = {}

        def policy(rows: int):
            if rows not in policy.chosen:
                curve = observed_curve(self.target, rows, at(rows, context), self.cfg.observed_min_steps,
                                       at=lambda ctx: at(rows, ctx))
                head = self.head_batch_ms(rows)
                if head is None:  # every row drafts on its own
                    over = lambda th: rows * self.overhead_ms(th)  # noqa: E731
                else:  # one head forward for the batch, the search (and the rest) per row
                    over = lambda th: head[rows] + rows * max(self.overhead_ms(th) - head[1], 0.0)  # noqa: E731
                chosen = choose_budget(tau, curve, over)
                widest = policy.chosen[max(policy.chosen)] if policy.chosen else None
                if (chosen["theta"] and widest is not None and widest["theta"] == 0
                        and chosen["expected_speedup_vs_ar"] < self.cfg.batch_resume_gain):
                    chosen = {**chosen, "theta": 0, "expected_speedup_vs_ar": 1.0, "fallback_to_ar": True}
                if chosen["theta"]:
                    for d in drafters:
                        d.set_cost_model(curve, self.overhead_ms(chosen["theta"]), tau)
                policy.chosen[rows] = {**chosen, "curve": curve}
            return policy.chosen[rows]["theta"], policy.chosen[rows]["curve"]

        policy.chosen = {}
        return policy


@torch.no_grad()
def head_forward_ms(new_drafter, target, rows: int = 1, repeats: int = 5) -> float:
    """Median ms of one DART head forward (`drafters.draft_logits_batch` for several rows, `draft_logits`
    for one) of drafters made by `new_drafter()`: two new positions per row after 128 cached, the full
    masks; round 0 feeds the 128-token prefix and warms up."""
    from .drafters import draft_logits_batch

    ds = [new_drafter() for _ in range(rows)]
    g = torch.Generator().manual_seed(0)
    H3, dev, dt = 3 * target.hidden_size, target.device, ds[0].head.fc.weight.dtype
    for d in ds:
        d.begin(target, torch.randint(3, min(1000, target.vocab_size), (129,), generator=g).tolist(), torch.randn(128, H3, generator=g).to(dev, dt))
    times = []
    for r in range(repeats + 1):
        sync(dev)
        t0 = time.perf_counter()
        draft_logits_batch(ds) if rows > 1 else ds[0].draft_logits()
        sync(dev)
        if r:
            times.append((time.perf_counter() - t0) * 1e3)
        for d in ds:
            d.observe([5, 6], torch.randn(2, H3, generator=g).to(dev, dt))
    return statistics.median(times)


def drafter_key(drafter) -> dict:
    """The drafter's config as its calibration depends on it: the arithmetic its head runs in, not the timings
    that chose it (`methods.fastest_head_dtype` measures them at every load: in the key, no load would find
    the calibration an earlier one cached)."""
    c = drafter.config()
    if isinstance(c.get("head_dtype"), dict):
        c = {**c, "head_dtype": c["head_dtype"].get("dtype")}
    return c


def weights_digest(drafter) -> str:
    """A cheap fingerprint of a drafter's head weights (every 997th value of every tensor): part of its
    calibration's cache key."""
    head = getattr(drafter, "head", None)
    if head is None:
        return ""
    h = hashlib.sha256()
    for name, p in head.state_dict().items():
        h.update(name.encode() + p.detach().float().flatten()[::997].cpu().numpy().tobytes())
    return h.hexdigest()[:16]
