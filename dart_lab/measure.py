"""What the budget measures and caches, per machine: the fingerprint a verify cost depends on, the cost files,
the timing of verifies of N-node trees (one sequence: `cost_curve`), the decoded steps' log read back
(`observed_curve`; `target.log_step` writes it) and progress lines. A leaf: it takes a target and times it, and knows no drafter, no engine
and no controller (`budget.py` is the controller; `cost.py` the pure cost model).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from .assets import cache_dir
from .atomic import write_json
from .config import BudgetConfig
from .cost import interpolate, monotone, padded
from .machine import LoadMeter
from .target import ONE_SEQUENCE, step_kind, sync  # noqa: F401 (ONE_SEQUENCE: observed_curve's rows)
from .tree import Tree


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
            "runner_revision": getattr(target, "runner_revision", 0),  # a cheaper runner re-measures its curve
            "compiled": ({"node_buckets": list(target.node_buckets), "key_bucket": target.key_bucket,
                          **({"mode": target.compile_mode} if getattr(target, "compile_mode", None) else {})}
                         if getattr(target, "compile", False) else False),
            **target.cost_key()}  # what the runner adds: its kernels' build, its 4-bit paths


@torch.no_grad()
def measure_verify(target, sizes, repeats: int = 7, prompt_len: int = 128) -> dict[int, float]:
    """Median wall ms of one verify of an N-node tree (see `verify_samples`)."""
    return {n: statistics.median(ts) for n, ts in verify_samples(target, sizes, repeats, prompt_len).items()}


def verify_samples(target, sizes, repeats: int = 7, prompt_len: int = 128) -> dict[int, list[float]]:
    """Wall ms of `repeats` verifies of an N-node tree (a chain; cost depends on N, not on shape)
    after `prompt_len` committed tokens, each size measured interleaved with the others, after one
    untimed warm-up round."""
    return time_chains(target, [prompt_len], sizes, repeats, lambda prompts: target.prefill(prompts[0]),
                        lambda trees: target.verify(trees[0]), lambda: target.commit([0]), target.truncate)


def time_chains(target, rows: list[int], sizes, repeats: int, prefill, verify, commit, truncate) -> dict[int, list]:
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


def say(line: str) -> None:
    """A progress line for measurements that take seconds to minutes (stderr: a bench's JSON stays clean)."""
    print(f"[dart_lab] {line}", file=sys.stderr, flush=True)


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
    kind = step_kind(target, rows)
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
