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

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from .assets import cache_dir
from .atomic import write_json
from .machine import LoadMeter
from .target import sync
from .tree import Tree

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
    # context, per node (reproduce/verify_latency.py, bf16 2-core EPYC: 16 / 32 nodes 32 / 42 ms after 128
    # tokens, 43 / 71 ms after 1,200; one node 25 ms at both), so a tree priced at 128 tokens is too big for
    # a long prompt (`curve_at`)
    max_nodes: int = 63  # widest tree probed in the calibration decode (drafted nodes)
    small_nodes: int = 4  # a second, small budget decoded in the calibration: drafting + search cost
    # depends on theta (DART: fewer MASK positions, a smaller beam; measured here 3.0-3.5 ms at theta
    # 2-4 vs 5.7-7 ms at 16-63), so the cost of small trees is measured, not scaled from the widest
    calibration_tokens: int = 48  # per calibration prompt
    refresh_ratio: float = 1.3  # observed / predicted verify time (median over a generation) that re-measures the curve
    refresh_min_steps: int = 8  # steps a generation needs before it can trigger a refresh
    refresh_streak: int = 2  # consecutive generations off by refresh_ratio (same side) before re-measuring: one
    # slow generation is often a passing host hiccup, and a curve re-measured inside it stuck (seen here: every
    # size up to 12 nodes read 40 ms against 27-31 ms steps, and dart drafted 11 nodes for a whole dataset)
    refresh_repeats: int = 5  # timed verifies per size when re-measuring
    cost_measurements: int = 3  # a cached curve is measured again at its next loads until this many measurements
    # were merged (per-size minimum): one measurement taken in a slow moment of the host stuck before (8 nodes
    # priced 1.51x one node where steps then cost 1.1x, and dart drafted theta 2 for a whole run)
    overhead_memory: int = 512  # steps a per-theta mean of drafting + search time remembers (it follows the machine)
    sampled_min_steps: int = 128  # sampled steps covering a rank before its sampled acceptance rate is used (fewer: one
    # short answer decided it, and a pessimistic rate can send sampling to AR fallback, which then sees no drafts)
    batch_sizes: tuple = (1, 2, 4, 8, 16, 32, 64)  # live-row counts at which batched verify cost is timed (between
    # them it is interpolated); a batch times the ones up to its own size, when it first runs
    batch_max_tokens: int = 512  # batched verify timed up to this many nodes in all (rows x nodes): wider batched
    # trees are priced by proportional growth (`interpolate`), which on a CPU already rules them out
    fallback_probe_every: int = 4  # while a runner is in AR fallback, every this many generations one decodes with
    # the best tree anyway (when the drafter learns theta in that mode): a fallback drafts no tree, so without a
    # probe no evidence could bring theta back (seen at T=1: dart-ctx on Alpaca fell back after two prompts and
    # stayed, tau 1.08, where dart at theta 4-5 kept 1.01x AR)


def calibration_key(cfg: BudgetConfig) -> dict:
    """The fields a calibration decode depends on (the rest steer the runner afterwards)."""
    return {k: getattr(cfg, k) for k in ("sizes", "repeats", "prompt_len", "max_nodes", "small_nodes",
                                         "calibration_tokens")}


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
            "hidden": target.hidden_size, "dtype": str(target.dtype), "runner": getattr(target, "runner", "hf"),
            "packed_weights": getattr(target, "packs_weights", False),
            "attention_dtype": str(getattr(target, "cache_dtype", target.dtype)),
            "runner_revision": getattr(target, "runner_revision", 0),  # a cheaper runner re-measures its curve
            "compiled": list(target.node_buckets) if getattr(target, "compile", False) else False}


@torch.no_grad()
def measure_verify(target, sizes, repeats: int = 7, prompt_len: int = 128) -> dict[int, float]:
    """Median wall ms of one verify of an N-node tree (see `verify_samples`)."""
    return {n: statistics.median(ts) for n, ts in verify_samples(target, sizes, repeats, prompt_len).items()}


def verify_samples(target, sizes, repeats: int = 7, prompt_len: int = 128) -> dict[int, list[float]]:
    """Wall ms of `repeats` verifies of an N-node tree (a chain; cost depends on N, not on shape)
    after `prompt_len` committed tokens, each size measured interleaved with the others, after one
    untimed warm-up round."""
    g = torch.Generator().manual_seed(0)
    V = min(target.vocab_size, 1000)
    target.prefill(torch.randint(3, V, (prompt_len,), generator=g))
    times = {n: [] for n in sizes}
    for r in range(repeats + 1):  # round 0 warms up
        for n in sizes:
            tree = Tree(torch.randint(3, V, (n,), generator=g), torch.arange(-1, n - 1))
            sync(target.device)
            t = time.perf_counter()
            target.verify(tree)
            sync(target.device)
            if r:
                times[n].append((time.perf_counter() - t) * 1e3)
            target.commit([0])
            target.truncate(prompt_len)
    return times


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The curve made non-decreasing in N, without letting one noisy size move the others. A bigger tree
    cannot cost less, but readings are noisy both ways (one calibration read N=2 at 29.7 ms, above N=4's
    27.4; one read the widest tree low, and a running minimum from the widest down then set every size,
    and the per-token context growth of every size, to that reading). So: 1. a size that breaks the
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
    key = hashlib.sha256(json.dumps([fp, [cfg.sizes, cfg.repeats, cfg.prompt_len, lens["long"]]],
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "cost" / f"{key}.json"
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
        with LoadMeter() as meter:
            raw = {c: measure_verify(target, cfg.sizes, cfg.repeats, n) for c, n in lens.items()}
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
    return {"fingerprint": fp, "verify_ms": short, "context_ms_per_token": per_token,
            "prompt_len": cfg.prompt_len, "measurements": count, "cached": not fresh,
            "contended": bool(load and load.get("contended")), "machine_load": load,
            "age_s": round(time.time() - measured_at, 1) if measured_at else None}


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
    theta 10 already runs all 8 forwards of theta 63 -- measured 31 ms, where a line from theta 4's 13 ms
    to theta 63's 25 ms said 15); beyond them: the nearest one times scale(theta) / scale(nearest)."""
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
    from .batch import BatchTarget

    g = torch.Generator().manual_seed(0)
    V = min(target.vocab_size, 1000)
    bt = BatchTarget(target)
    bt.prefill([torch.randint(3, V, (prompt_len,), generator=g) for _ in range(batch)])
    times = {n: [] for n in sizes}
    for r in range(repeats + 1):  # round 0 warms up
        for n in sizes:
            trees = [Tree(torch.randint(3, V, (n,), generator=g), torch.arange(-1, n - 1)) for _ in range(batch)]
            sync(target.device)
            t = time.perf_counter()
            bt.verify(trees)
            sync(target.device)
            if r:
                times[n].append((time.perf_counter() - t) * 1e3)
            bt.commit([[0]] * batch)
            bt.truncate(prompt_len)
    return {n: statistics.median(ts) for n, ts in times.items()}


def batch_cost_curve(target, batch: int, cfg: BudgetConfig = BudgetConfig(), cache: bool = True) -> dict[int, float]:
    """{N: ms} of one step verifying `batch` rows of N nodes each (the surface t(B, N) at one B), timed at
    the sizes of `cfg.sizes` with batch x N <= cfg.batch_max_tokens, cached per machine like `cost_curve`;
    non-decreasing in N (`monotone`)."""
    sizes = [n for n in cfg.sizes if n == 1 or batch * n <= cfg.batch_max_tokens]
    fp = fingerprint(target)
    key = hashlib.sha256(json.dumps([fp, batch, sizes, cfg.refresh_repeats, cfg.prompt_len], sort_keys=True)
                         .encode()).hexdigest()[:16]
    path = cache_dir() / "cost" / f"batch_{key}.json"
    if cache and path.is_file():
        try:
            return monotone({int(k): float(v) for k, v in json.loads(path.read_text())["verify_ms"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    with LoadMeter() as meter:
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
