"""The automatic tree budget's controller (beyond the paper: the released code fixes 60 nodes): it calibrates a
drafter on a target (a cost curve from `measure`, a decode of the calibration prompts at the widest and a small
budget), chooses theta per request and per batch from the cost model (`cost`), learns from every generation, and
owns the drafting policy (`policy.policy_for`: what it asks of a drafter beyond begin / propose / observe). It sits
above the decode loop and the engine: it decodes its calibrations and times batched verifies.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field

import torch

from .assets import cache_dir
from .atomic import write_json
from .config import BudgetConfig
from .cost import choose_budget, curve_at, interpolate, interpolate_batch, monotone, overhead_at
from .machine import LoadMeter
from .measure import ONE_SEQUENCE, cost_curve, cost_file, fingerprint, observed_curve, read_quiet, say, time_chains
from .policy import policy_for
from .target import sync

DRAFTING_REVISION = 1  # part of every calibration's key: raise it when the drafters' or the search's cost changes, so


# short generic requests, none from a benchmark set: the calibration decode must not see test prompts
CALIBRATION_PROMPTS = ("Explain how a refrigerator keeps food cold.",
                       "Write a short story about a lighthouse keeper.",
                       "What are the pros and cons of remote work?")


def calibration_key(cfg: BudgetConfig) -> dict:
    """The fields a calibration decode depends on (the rest steer the runner afterwards)."""
    return {k: getattr(cfg, k) for k in ("sizes", "repeats", "prompt_len", "max_nodes", "small_nodes",
                                         "calibration_tokens", "calibration_warmup_tokens")}


@torch.no_grad()
def batch_verify_ms(target, batch: int, sizes, repeats: int = 5, prompt_len: int = 128) -> dict[int, float]:
    """Median wall ms of one batched verify (`batch_target.BatchTarget`) of `batch` rows with an N-node chain
    each, after `prompt_len` committed tokens per row, sizes interleaved after a warm-up round."""
    from .engine.batch_target import BatchTarget

    bt = BatchTarget(target)
    times = time_chains(target, [prompt_len] * batch, sizes, repeats, bt.prefill, bt.verify,
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
        self.policy = policy_for(drafter)  # what the budget asks of the drafter beyond the decode loop's steps
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
        return overhead_at(means, theta, lambda th: self.policy.cost_scale(th, self.cfg.max_nodes))

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
            self.policy.set_cost_model(curve or self.cost["verify_ms"], self.overhead_ms(theta), budget["tau_by_theta"])

    def for_context(self, budget: dict, curve: dict[int, float]) -> dict:
        """`budget` re-chosen for one request: the same tau(theta), each tree priced by the verify curve at
        the request's context length (`curve_at`; a long prompt makes every node dearer)."""
        if curve is self.cost["verify_ms"]:
            return budget
        return {**budget, **choose_budget(budget["tau_by_theta"], curve, self.overhead_ms)}

    def learns(self, sampled: bool) -> bool:
        """Does this drafter's theta follow the acceptance it observes in this mode (`DraftPolicy.adapts`)?"""
        return self.policy.adapts(sampled)

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
                        policy_for(d).set_cost_model(curve, self.overhead_ms(chosen["theta"]), tau)
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
