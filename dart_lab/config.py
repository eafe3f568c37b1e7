"""Configuration as frozen dataclasses of plain values.

Every result records `dataclasses.asdict(cfg)`, so a number can always be traced to the settings
that produced it. Validation happens in `__post_init__` and raises `DartLabError` with one line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import DartLabError
from .smoke import pick


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode: length, stop rule and the target's sampling distribution.

    temperature == 0 means greedy (argmax); otherwise logits / temperature, then top-k (0 = off),
    then top-p (1.0 = off) define the distribution that speculative decoding must preserve.
    """

    max_new_tokens: int = field(default=128, metadata={"help": "tokens to generate"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (1.0 = off)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0 = off)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    stop_on_eos: bool = field(default=True, metadata={"help": "stop at the target's EOS"})

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise DartLabError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise DartLabError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise DartLabError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise DartLabError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "dart"  # dart | eagle3
    draft_vocab_size: int = 8192
    draft_length: int = 7  # DART: masks per block (levels = draft_length + 1)
    gamma: float = 0.6  # DART annealing: level t weighs gamma^(t-1)
    shifted: bool = True  # DART: level 0 from the last prefix position (False: first mask, Table 3)
    anchors_per_seq: int = 64  # DART: mask blocks sampled per sequence (compute bound)
    ttt_steps: int = 7  # EAGLE-3 unroll
    ttt_decay: float = 0.8
    lr: float = 1e-3
    warmup_steps: int = 30
    max_steps: int = 600
    time_budget_min: float = 0.0  # > 0: stop at this wall time (the step count sets the schedule)
    seqs_per_step: int = 2
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    save_every: int = 50
    val_every: int = 100
    val_examples: int = 16
    autocast: bool = True
    init_from_target: bool = True
    init_from: str = ""  # a trained head folder to continue from (its draft vocabulary is kept)
    decode_every: int = 0  # > 0: every this many steps, decoding tau (60-node tree, T=0) on fixed prompts
    decode_tokens: int = 48  # new tokens per decoding-tau prompt

    def __post_init__(self):
        if self.kind not in ("dart", "eagle3"):
            raise DartLabError(f"unknown head kind {self.kind!r}: dart or eagle3")
        if not (0 < self.gamma <= 1.0):
            raise DartLabError(f"gamma must be in (0, 1], got {self.gamma}")
        if self.max_steps < 1:
            raise DartLabError("max_steps must be >= 1")
