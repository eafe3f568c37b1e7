"""Method registry: every decoding method by name, built for a target as a `Runner` with
`generate(ids, cfg)`; the CLI, the benchmark and the reproduction know methods only through it.

Heads: an explicit path, else the trained heads shipped for the embedded target
(dart_lab/heads/<target>/{dart,eagle3}), else — only when asked with `random_heads=True`, for
plumbing tests — freshly initialised heads (correct but useless drafts; results say so).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .assets import cache_dir, resolve_hub
from .atomic import write_json
from .batch import BatchResult, generate_batch, hf_generate_batch
from .budget import (CALIBRATION_PROMPTS, BudgetConfig, batch_cost_curve, calibration_key, choose_budget, cost_curve,
                     curve_at, interpolate, interpolate_batch, overhead_at)
from .config import GenerationConfig
from .draft_head import DartHead, Eagle3Head, HeadConfig
from .drafters import (ContextConfig, ContextDrafter, DartDrafter, Eagle3Drafter, Eagle3TreeConfig, PLDDrafter,
                       SPSDrafter, draft_logits_batch)
from .errors import DartLabError
from .generate import Drafter, GenerationResult, generate, hf_generate
from .loading import load_target
from .machine import LoadMeter
from .target import sync
from .ngram import NGram, build_ngram
from .search import TreeSearchConfig

HEADS_DIR = Path(__file__).resolve().parent / "heads"


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class MethodOptions:
    """What the methods are built from; the CLI's flags are generated from these fields."""

    dart_head: str = _opt("", "DART head folder (config.json + model.safetensors); default: the shipped head")
    eagle3_head: str = _opt("", "EAGLE-3 head folder; default: the shipped head")
    ngram: str = _opt("sharegpt", "n-gram table: sharegpt | jsonl:PATH | FILE.npz | FILE.trie")
    ngram_max_tokens: int = _opt(0, "n-gram corpus tokens (0 = the whole corpus)")
    sps_model: str = _opt("", "sps: HF id/path of a smaller LM with the target's tokenizer")
    sps_draft_len: int = _opt(5, "sps: draft chain length")
    random_heads: bool = _opt(False, "untrained heads where none is shipped (plumbing checks only)")
    pld_max_ngram: int = _opt(3, "pld: longest suffix matched")
    pld_num_pred: int = _opt(10, "pld: tokens copied")
    draft_length: int = _opt(0, "DART masks per forward (0 = the head's own)")
    tree_nodes: str = _opt("auto", "drafted tree nodes, root excluded: auto (chosen from this machine's measured "
                                   "verify cost and the head's acceptance, see budget.py) | paper (DART 60, "
                                   "EAGLE-3 59, the released defaults) | a number")


def shipped_head(target, kind: str) -> Path | None:
    p = HEADS_DIR / target.name / kind
    return p if (p / "config.json").is_file() else None


def random_head(target, kind: str, seed: int = 0, draft_length: int = 7, shifted: bool = True):
    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(target.model.config, draft_vocab_size=min(target.vocab_size, 8192),
                                draft_length=draft_length, shifted=shifted)
    head = (DartHead if kind == "dart" else Eagle3Head)(cfg)
    head.set_vocab(torch.arange(cfg.draft_vocab_size))
    head.attach_embedding(target.model.get_input_embeddings())
    return head.to(device=target.device, dtype=target.dtype).eval()


def load_head(target, kind: str, path: str, random_heads: bool):
    cls = DartHead if kind == "dart" else Eagle3Head
    if path:
        return cls.load(resolve_hub(path), target=target)
    shipped = shipped_head(target, kind)
    if shipped is not None:
        return cls.load(shipped, target=target)
    if random_heads:
        return random_head(target, kind)
    raise DartLabError(f"no {kind} head for target {target.name!r}: pass --{kind}-head PATH "
                       f"(train one with `dart-lab train {kind}`) or --random-heads for a plumbing run")


def load_ngram_for(target, spec: str, max_tokens: int = 0):
    if spec.endswith((".npz", ".trie")):
        path = resolve_hub(spec) if spec.startswith("hub:") else Path(spec)
        if not path.is_file():
            raise DartLabError(f"n-gram file not found: {spec}")
        return NGram.load(path, vocab_size=target.vocab_size)
    if target.tokenizer is None:
        raise DartLabError("building an n-gram table needs the target's tokenizer")
    return build_ngram(target.tokenizer, spec, max_tokens=max_tokens or None)


def _dart_head(target, opts: MethodOptions, cache: dict):
    if "dart_head" not in cache:
        cache["dart_head"] = load_head(target, "dart", opts.dart_head, opts.random_heads)
    head = cache["dart_head"]
    if opts.draft_length:
        head.cfg = dataclasses.replace(head.cfg, draft_length=opts.draft_length)
    return head


def tree_budget(opts: MethodOptions) -> int | None:
    """Drafted nodes asked for: a number, None for auto (widest probe first, then chosen), 0 = paper."""
    v = str(opts.tree_nodes).strip().lower()
    if v == "auto":
        return None
    if v in ("paper", "0"):
        return 0
    try:
        n = int(v)
    except ValueError:
        raise DartLabError(f"--tree-nodes must be auto, paper or a number >= 1, got {opts.tree_nodes!r}") from None
    if n < 1:
        raise DartLabError(f"--tree-nodes must be auto, paper or a number >= 1, got {opts.tree_nodes!r}")
    return n


def _nodes(opts: MethodOptions) -> int:
    n = tree_budget(opts)
    return BudgetConfig().max_nodes if n is None else n  # auto: probe with the widest tree


def _search(opts: MethodOptions, **kw) -> TreeSearchConfig:
    n = _nodes(opts)
    return TreeSearchConfig(**({"max_nodes": n} if n else {}), **kw)


def _dart(target, opts, cache):
    head = _dart_head(target, opts, cache)
    if "ngram" not in cache:
        cache["ngram"] = load_ngram_for(target, opts.ngram, opts.ngram_max_tokens)
    return DartDrafter(head, cache["ngram"], _search(opts))


def _dart_no_ngram(target, opts, cache):
    return DartDrafter(_dart_head(target, opts, cache), None, _search(opts, w_ngram=0.0), name="dart-no-ngram")


def _dart_ctx(name: str, **ctx):
    """dart-ctx and its ablations: ContextConfig fields changed from the defaults."""
    def build(target, opts, cache):
        head = _dart_head(target, opts, cache)
        if "ngram" not in cache:
            cache["ngram"] = load_ngram_for(target, opts.ngram, opts.ngram_max_tokens)
        return ContextDrafter(head, cache["ngram"], _search(opts), ContextConfig(**ctx), name=name)
    return build


def _eagle3(target, opts, cache):
    if "eagle3_head" not in cache:
        cache["eagle3_head"] = load_head(target, "eagle3", opts.eagle3_head, opts.random_heads)
    # the released total_token counts the root: n drafted nodes = total_tokens - 1
    n = _nodes(opts)
    tree = Eagle3TreeConfig(total_tokens=n + 1) if n else Eagle3TreeConfig()
    return Eagle3Drafter(cache["eagle3_head"], tree)


def _sps(target, opts, cache):
    if not opts.sps_model:
        raise DartLabError("sps needs a draft model: pass --sps-model ID_OR_PATH")
    if "sps" not in cache:
        cache["sps"] = load_target(opts.sps_model, device=str(target.device), dtype=target.dtype)
    if cache["sps"].vocab_size > target.vocab_size:
        raise DartLabError(f"sps draft vocabulary ({cache['sps'].vocab_size}) exceeds the target's ({target.vocab_size})")
    return SPSDrafter(cache["sps"], opts.sps_draft_len)


def _weights_digest(drafter) -> str:
    """A cheap fingerprint of a drafter's head weights (every 997th value of every tensor)."""
    head = getattr(drafter, "head", None)
    if head is None:
        return ""
    h = hashlib.sha256()
    for name, p in head.state_dict().items():
        h.update(name.encode() + p.detach().float().flatten()[::997].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Runner:
    """A decoding method bound to a target: `generate(ids, cfg) -> GenerationResult`.
    With an automatic tree budget (`budget.py`) it calibrates once when built, drafts with the theta
    chosen for each request's context length (`_for_context`; when no theta beats AR: plain AR steps,
    or what the drafter can do without a tree, `Drafter.without_tree`), and re-chooses theta after every
    generation from the acceptance it observed (steps at budget b inform every theta <= b)."""

    def __init__(self, name: str, target, drafter: Drafter | None = None, hf: bool = False,
                 hf_lookup: int | None = None, auto_budget: bool = False, new_drafter: Callable | None = None,
                 refresh: bool = False):
        self.name, self.target, self.drafter, self.hf, self.hf_lookup = name, target, drafter, hf, hf_lookup
        self.new_drafter = new_drafter  # () -> another drafter of this method (the rows of a batch)
        self._row_drafters: list[Drafter] = []
        self._batch_costs: dict[int, dict[int, float]] = {}  # batch size -> verify ms by nodes per row
        self._head_ms: dict[int, float] = {}  # rows -> ms of one batched DART head forward (head_batch_ms)
        self.budget: dict | None = None  # greedy decoding's theta (and sampling's: budget_sampled)
        self.budget_sampled: dict | None = None
        self._observed_sampled: list = []
        self._off_streak = 0  # consecutive generations whose verify times disagreed with the curve (signed)
        self._fallback_runs = {False: 0, True: 0}  # generations in AR fallback, per mode (sampled or not)
        if auto_budget and drafter is not None:
            self._calibrate(refresh)  # refresh: measure again instead of reading the caches (`dart-lab calibrate`)

    # -- automatic tree budget
    def _calibrate(self, refresh: bool = False) -> None:
        """Cost curve (cached per machine) and a decode of the calibration prompts at the widest budget
        (its path ranks give tau(theta) for every theta) and at a small one (drafting + search cost
        at both ends), cached per drafter: head weights, n-gram, search settings, target and dtype."""
        cfg = BudgetConfig()
        t = self.target
        self.cost = cost_curve(t, cfg, refresh=refresh)
        key = {"drafter": self.drafter.config(), "weights": _weights_digest(self.drafter), "target": t.name,
               "dtype": str(t.dtype), "budget": calibration_key(cfg), "prompts": CALIBRATION_PROMPTS,
               "machine": self.cost["fingerprint"]}  # drafting time depends on the machine and runner
        path = cache_dir() / "calibration" / (hashlib.sha256(json.dumps(key, sort_keys=True, default=str)
                                                              .encode()).hexdigest()[:16] + ".json")
        try:
            if refresh:
                raise OSError("measure again")
            saved = json.loads(path.read_text())
            self._observed = [tuple(x) for x in saved["observed"]]
            self._overhead_obs = {int(k): v for k, v in saved["overhead_obs"].items()}
        except (OSError, ValueError, KeyError):
            self._observed, self._overhead_obs = [], {}  # (budget, path_ranks) of every step; theta -> [ms sum, steps]
            with LoadMeter() as meter:
                for budget in (cfg.max_nodes, cfg.small_nodes):  # ranks from the widest; the cost of a small tree too
                    self.drafter.set_budget(budget)
                    for text in CALIBRATION_PROMPTS:
                        ids = t.encode_prompt(text) if t.tokenizer is not None else \
                            torch.randint(3, t.vocab_size, (16,), generator=torch.Generator().manual_seed(len(text)))
                        res = generate(t, ids, self.drafter, GenerationConfig(max_new_tokens=cfg.calibration_tokens))
                        self._observe(res, budget)
            if not meter.load["contended"]:  # drafting times of a busy moment serve this run only
                write_json(path, {"observed": self._observed, "overhead_obs": self._overhead_obs,
                                  "machine_load": meter.load, "measured_at": time.time()})
        self._choose()

    def _follow_machine(self, res: GenerationResult, curve: dict[int, float]) -> bool:
        """Keep the cost curve true to the machine as it is now. When the verify steps just decoded took
        `refresh_ratio` x longer (or shorter) than the curve predicts for their tree sizes (median over
        steps) in `refresh_streak` generations in a row, the curve is measured again (not cached) and
        theta is re-chosen. A busy machine changes the curve's shape, not only its scale -- one-token
        steps slowed 4x under contention here while a tree verify, the same number of ops, slowed far
        less -- so a rescale would not do."""
        cfg = BudgetConfig()
        obs = [(s["tree_size"], s["verify_ms"]) for s in res.steps if "tree_size" in s]
        if len(obs) < cfg.refresh_min_steps:
            return False
        ratio = statistics.median(ms / interpolate(curve, n) for n, ms in obs)  # curve: the request's context
        side = 1 if ratio > cfg.refresh_ratio else -1 if ratio < 1 / cfg.refresh_ratio else 0
        # count generations off the curve on the same side in a row (signed); a good one or a flip restarts
        self._off_streak = self._off_streak + side if side and self._off_streak * side > 0 else side
        if abs(self._off_streak) < cfg.refresh_streak:
            return False
        self._off_streak = 0
        self.cost = {**cost_curve(self.target, dataclasses.replace(cfg, repeats=cfg.refresh_repeats), cache=False),
                     "refreshes": self.cost.get("refreshes", 0) + 1, "refresh_trigger_ratio": round(ratio, 3)}
        return True

    def _observe(self, res: GenerationResult, budget: int, sampled: bool = False, ranks: bool = True) -> None:
        """Record a generation drafted with `budget`: its steps' path ranks (for tau(theta), unless
        ranks=False) and their drafting + search time (for the cost of that theta: every tree step,
        greedy or sampled -- the time does not depend on how the tree is accepted)."""
        if ranks:
            (self._observed_sampled if sampled else self._observed).extend(
                (budget, s["path_ranks"]) for s in res.steps if "path_ranks" in s)
        ms = [s["draft_ms"] + s["search_ms"] for s in res.steps if "path_ranks" in s and not s.get("copy_only")]
        if ms:
            tot, n = self._overhead_obs.get(budget, (0.0, 0))
            keep = min(1.0, BudgetConfig().overhead_memory / (n + len(ms)))  # forget old steps: follow the machine
            self._overhead_obs[budget] = [(tot + sum(ms)) * keep, (n + len(ms)) * keep]

    def overhead_ms(self, theta: int) -> float:
        """Expected drafting + search ms per step at budget `theta` (`budget.overhead_at` over the
        per-theta means measured in the calibration and while decoding)."""
        means = {b: tot / n for b, (tot, n) in self._overhead_obs.items() if n > 0}
        return overhead_at(means, theta, lambda th: self.drafter.draft_cost_scale(th, BudgetConfig().max_nodes))

    @staticmethod
    def _rank_rates(observed, probe: int, min_steps: int = 1) -> list[float | None]:
        """P(the rank-k node is accepted) for k < probe, each over the steps whose budget covered rank k
        (None where fewer than min_steps did)."""
        out = []
        for k in range(probe):
            rs = [r for b, r in observed if b > k]
            out.append(statistics.fmean(sum(1 for x in r if x == k) for r in rs) if len(rs) >= min_steps else None)
        return out

    def _choose(self, sampled: bool = False) -> None:
        """Re-choose theta from everything observed: greedy decoding's, or (sampled=True) sampling's,
        where drafts are accepted less often and a smaller tree can pay better."""
        probe = BudgetConfig().max_nodes
        # tau(theta) = 1 + sum over k < theta of P(the rank-k node is accepted), each term over the
        # steps whose budget covered rank k. Why per term: after theta is chosen, only ranks < theta
        # get new (bench-prompt) steps; averaging whole sums per theta would mix two prompt
        # populations at the boundary and make tau(theta) jump and dip there, pulling theta toward
        # wherever it already is. Per-term estimates keep tau(theta) non-decreasing.
        # Sampling (T > 0): a rank's rate from the sampled steps once `sampled_min_steps` of them
        # covered it, else the greedy rate scaled by what the covered ranks show (sampled over greedy
        # acceptance, at most 1). Unscaled, the ranks beyond the current theta kept greedy decoding's rates
        # and looked twice as good as they were: dart at T=1 on Alpaca drafted theta 11 for 20 prompts
        # (0.96x AR) before those ranks were covered and priced every theta below AR (covered ranks
        # accepted 0.4-0.6x as often as at T=0). With no covered rank yet, the greedy rate as it is.
        rates = self._rank_rates(self._observed, probe)
        if sampled:
            own = self._rank_rates(self._observed_sampled, probe, BudgetConfig().sampled_min_steps)
            greedy = [r or 0.0 for r in rates]
            greedy_seen = sum(r for o, r in zip(own, greedy) if o is not None)
            scale = min(1.0, sum(o for o in own if o is not None) / greedy_seen) if greedy_seen > 0 else 1.0
            rates = [o if o is not None else r * scale for o, r in zip(own, greedy)]
        tau = [1.0]
        for r in rates:
            tau.append(tau[-1] + (r or 0.0))
        budget = {**choose_budget(tau, self.cost["verify_ms"], self.overhead_ms),
                  "tau_by_theta": [round(v, 4) for v in tau],
                  "steps_observed": len(self._observed_sampled if sampled else self._observed),
                  "verify_ms": self.cost["verify_ms"], "fingerprint": self.cost["fingerprint"],
                  "cost_refreshes": self.cost.get("refreshes", 0)}
        if sampled:
            self.budget_sampled = budget
        else:
            self.budget = budget
        self._apply(budget)

    def _apply(self, budget: dict, curve: dict[int, float] | None = None) -> None:
        """Put `budget`'s theta (and the cost model behind it, `curve`: verify ms by tree size) on the drafter."""
        theta = budget["theta"]
        if theta:
            self.drafter.set_budget(theta)
            self.drafter.set_cost_model(curve or self.cost["verify_ms"], self.overhead_ms(theta),
                                        budget["tau_by_theta"])

    def _for_context(self, budget: dict, curve: dict[int, float]) -> dict:
        """`budget` re-chosen for one request: the same tau(theta), each tree priced by the verify curve at
        the request's context length (`budget.curve_at`; a long prompt makes every node dearer)."""
        if curve is self.cost["verify_ms"]:
            return budget
        return {**budget, **choose_budget(budget["tau_by_theta"], curve, self.overhead_ms)}

    def _learns(self, sampled: bool) -> bool:
        """Does this drafter's theta follow the acceptance it observes in this mode (`Drafter.adapts_budget`)?"""
        return self.drafter.adapts_budget_sampled if sampled else self.drafter.adapts_budget

    def _probe(self, budget: dict, sampled: bool) -> dict:
        """In AR fallback, every `fallback_probe_every`-th generation decodes with the best tree anyway
        (the theta of the highest expected speed): a fallback drafts no tree, so only a probe's steps can
        show that trees pay again (BudgetConfig.fallback_probe_every)."""
        self._fallback_runs[sampled] += 1
        if self._fallback_runs[sampled] % BudgetConfig().fallback_probe_every:
            return budget
        speed = budget["expected_speedup_by_theta"]
        theta = max(range(1, len(speed)), key=lambda th: (speed[th], -th))
        return {**budget, "theta": theta, "fallback_to_ar": False, "probe": True}

    def generate(self, prompt_ids, cfg: GenerationConfig = GenerationConfig()) -> GenerationResult:
        if self.hf:
            return hf_generate(self.target, prompt_ids, cfg, prompt_lookup_num_tokens=self.hf_lookup)
        sampled = not cfg.greedy
        budget = curve = None
        if self.budget is not None:  # sampling has its own theta, from its own acceptance
            if sampled and self.budget_sampled is None:
                self._choose(sampled=True)
            # every tree priced at this request's mean committed context (prompt + half the answer)
            context = len(prompt_ids) + cfg.max_new_tokens // 2
            curve = curve_at(self.cost, context)
            budget = {**self._for_context(self.budget_sampled if sampled else self.budget, curve), "context": context}
            if budget["fallback_to_ar"] and self._learns(sampled):
                budget = self._probe(budget, sampled)
            self._apply(budget, curve)
        fallback = budget is not None and budget["fallback_to_ar"]
        drafter = self.drafter.without_tree(curve) if fallback else self.drafter
        res = generate(self.target, prompt_ids, drafter, cfg)
        res.method = self.name
        if budget is not None:
            refreshed = self._follow_machine(res, curve)
            if not fallback:
                self._observe(res, budget["theta"], sampled, ranks=self._learns(sampled))
            if refreshed:  # a new cost curve: both thetas again
                self._choose()
            if refreshed or not fallback:
                self._choose(sampled)
            res.config["tree_budget"] = {k: budget[k] for k in ("theta", "fallback_to_ar", "expected_speedup_vs_ar",
                                                                "context") + (("probe",) if "probe" in budget else ())}
        return res

    # -- batches (batch.py): one drafter per row, theta per live-row count
    def generate_batch(self, prompts, cfg: GenerationConfig = GenerationConfig()) -> BatchResult:
        """Decode `prompts` together (`batch.generate_batch`); row 0 drafts with this runner's drafter,
        the others with drafters of the same method (`new_drafter`), kept for later batches. With the
        automatic budget, theta is chosen for the batch's live rows (`_batch_policy`)."""
        if self.hf:
            return hf_generate_batch(self.target, prompts, cfg, self.hf_lookup, name=self.name)
        drafters = None
        if self.drafter is not None:
            while len(self._row_drafters) < len(prompts) - 1:
                self._row_drafters.append(self.new_drafter())
            drafters = [self.drafter] + self._row_drafters[:len(prompts) - 1]
        policy = self._batch_policy(prompts, cfg, drafters) if self.budget is not None else None
        res = generate_batch(self.target, prompts, drafters, cfg, policy, name=self.name)
        if policy is not None:
            res.config["tree_budget_by_rows"] = {str(r): {k: ch[k] for k in ("theta", "expected_speedup_vs_ar",
                                                                            "fallback_to_ar")}
                                                 for r, ch in sorted(policy.chosen.items())}
        return res

    def batch_curve(self, rows: int) -> dict[int, float]:
        """Verify ms of one step over `rows` rows by nodes per row: the measured surface t(B, N)
        (`budget.batch_cost_curve` at the batch sizes around `rows`), interpolated in B."""
        sizes = BudgetConfig().batch_sizes
        lo = max((b for b in sizes if b <= rows), default=sizes[0])
        hi = min((b for b in sizes if b >= rows), default=sizes[-1])
        for b in {lo, hi}:
            if b not in self._batch_costs:
                self._batch_costs[b] = batch_cost_curve(self.target, b)
        return interpolate_batch({b: self._batch_costs[b] for b in {lo, hi}}, rows)

    @torch.no_grad()
    def head_batch_ms(self, rows: int, repeats: int = 5) -> dict[int, float] | None:
        """{1: ms, rows: ms} of one DART head forward for a single row and for `rows` rows together
        (`drafters.draft_logits_batch`; two new positions per row after 128 cached, the full masks), timed
        here once per size; None for drafters without a batched head forward (EAGLE-3, pld, ...)."""
        if self.drafter is None or not isinstance(self.drafter, DartDrafter) or self.new_drafter is None:
            return None
        for n in {1, rows} - set(self._head_ms):
            ds = [self.new_drafter() for _ in range(n)]
            g = torch.Generator().manual_seed(0)
            H3, dev = 3 * self.target.hidden_size, self.target.device
            for d in ds:
                d.begin(self.target, torch.randint(3, 1000, (129,), generator=g).tolist(),
                        torch.randn(128, H3, generator=g).to(dev, self.target.dtype))
            times = []
            for r in range(repeats + 1):  # round 0 feeds the 128-token prefix and warms up
                sync(dev)
                t0 = time.perf_counter()
                draft_logits_batch(ds) if n > 1 else ds[0].draft_logits()
                sync(dev)
                if r:
                    times.append((time.perf_counter() - t0) * 1e3)
                for d in ds:
                    d.observe([5, 6], torch.randn(2, H3, generator=g).to(dev, self.target.dtype))
            self._head_ms[n] = statistics.median(times)
        return self._head_ms

    def _batch_policy(self, prompts, cfg: GenerationConfig, drafters):
        """live rows -> (theta, verify curve): tau(theta) per row from this runner's calibration, the step
        priced by the batched surface at that many rows (grown to the batch's mean context as the batch-1
        curve grows) plus every row's drafting + search, each row's tokens counted:
            expected speed(theta) = rows * tau(theta) / (t(rows, theta + 1) + rows * t_draft(theta)).
        Re-chosen whenever rows finish; theta 0 = batched AR steps."""
        sampled = not cfg.greedy
        if sampled and self.budget_sampled is None:
            self._choose(sampled=True)
        tau = (self.budget_sampled if sampled else self.budget)["tau_by_theta"]
        for rows in range(1, len(prompts) + 1):  # time the surface now, not inside the timed decode
            self.batch_curve(rows)
            self.head_batch_ms(rows)
        context = statistics.fmean(len(p) for p in prompts) + cfg.max_new_tokens // 2
        short, long = self.cost["verify_ms"], curve_at(self.cost, context)
        grow = {n: long[n] / short[n] for n in short}

        def policy(rows: int):
            if rows not in policy.chosen:
                curve = {n: ms * interpolate(grow, n) for n, ms in self.batch_curve(rows).items()}
                head = self.head_batch_ms(rows)
                if head is None:  # every row drafts on its own
                    over = lambda th: rows * self.overhead_ms(th)  # noqa: E731
                else:  # one head forward for the batch, the search (and the rest) per row
                    over = lambda th: head[rows] + rows * max(self.overhead_ms(th) - head[1], 0.0)  # noqa: E731
                chosen = choose_budget(tau, curve, over)
                if chosen["theta"]:
                    for d in drafters:
                        d.set_cost_model(curve, self.overhead_ms(chosen["theta"]), tau)
                policy.chosen[rows] = {**chosen, "curve": curve}
            return policy.chosen[rows]["theta"], policy.chosen[rows]["curve"]

        policy.chosen = {}
        return policy

    def config(self) -> dict:
        out = self.drafter.config() if self.drafter is not None else {"name": self.name}
        if self.hf_lookup:
            out["prompt_lookup_num_tokens"] = self.hf_lookup
        if self.budget is not None:
            out["tree_budget"] = self.budget
        if self.budget_sampled is not None:
            out["tree_budget_sampled"] = self.budget_sampled
        return out


@dataclass(frozen=True)
class Method:
    """A registry entry. drafter: (target, opts, cache) -> Drafter, None for the decode loop's plain
    AR steps; hf: run by Hugging Face `generate` instead (the external reference)."""

    name: str
    help: str
    drafter: Callable | None = None
    hf: bool = False
    hf_lookup: int | None = None
    samples: bool = True  # False: greedy only (HF prompt lookup does not sample)
    budgeted: bool = False  # a tree builder with a node budget (`--tree-nodes auto` applies)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar", "plain autoregressive decoding (our decode loop, one-node trees)"),
    Method("dart", "DART head + n-gram-guided tree search (the paper)", _dart, budgeted=True),
    Method("dart-no-ngram", "DART without the n-gram term (paper Table 2)", _dart_no_ngram, budgeted=True),
    Method("eagle3", "EAGLE-3 head + dynamic tree", _eagle3, budgeted=True),
    Method("dart-ctx", "beyond the paper: DART + request-local n-gram + copy candidates", _dart_ctx("dart-ctx"),
           budgeted=True),
    Method("dart-ctx-ngram", "dart-ctx ablation: request-local n-gram only", _dart_ctx("dart-ctx-ngram", copy=False),
           budgeted=True),
    Method("dart-ctx-copy", "dart-ctx ablation: copy candidates only", _dart_ctx("dart-ctx-copy", w_context=0.0),
           budgeted=True),
    Method("dart-ctx-pooled", "dart-ctx ablation: one copy probability for every match length, matches up to 3 "
           "tokens (the previous rule)", _dart_ctx("dart-ctx-pooled", copy_match_buckets=1, copy_max_ngram=3),
           budgeted=True),
    Method("dart-ctx-branch", "dart-ctx + a copy under each of the head's 2 likeliest first tokens (copy_branches=2)",
           _dart_ctx("dart-ctx-branch", copy_branches=2), budgeted=True),
    Method("dart-ctx-aperiodic", "dart-ctx ablation: copies stop at the end of the text (no periodic run-on)",
           _dart_ctx("dart-ctx-aperiodic", copy_periodic=False), budgeted=True),
    Method("pld", "prompt lookup decoding", lambda t, o, c: PLDDrafter(o.pld_max_ngram, o.pld_num_pred)),
    Method("sps", "speculative sampling with a smaller draft LM (--sps-model)", _sps),
    Method("hf", "Hugging Face generate (external reference)", hf=True),
    Method("hf-pld", "Hugging Face generate with prompt lookup (greedy only)", hf=True, hf_lookup=10, samples=False),
)}


def get_method(name: str) -> Method:
    """The registry entry of `name`; the one place an unknown method name is refused."""
    if name not in METHODS:
        raise DartLabError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]


def make_drafter(name: str, target, opts: MethodOptions = MethodOptions(), cache: dict | None = None):
    """The Drafter of method `name` (None for methods without one: ar, hf, hf-pld).
    `cache` (dict) shares heavy objects (heads, n-gram table) between methods of one run."""
    m = get_method(name)
    return m.drafter(target, opts, {} if cache is None else cache) if m.drafter else None


def make_runner(name: str, target, opts: MethodOptions = MethodOptions(), cache: dict | None = None,
                refresh: bool = False) -> Runner:
    """Method `name` bound to `target`, ready to `generate`. refresh: re-measure the automatic budget's
    cost curve and calibration instead of reading them from the cache."""
    m = get_method(name)
    auto = m.budgeted and tree_budget(opts) is None
    cache = {} if cache is None else cache
    return Runner(name, target, make_drafter(name, target, opts, cache), hf=m.hf, hf_lookup=m.hf_lookup,
                  auto_budget=auto, new_drafter=lambda: make_drafter(name, target, opts, cache), refresh=refresh)
