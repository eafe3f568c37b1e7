"""Method registry: every decoding method by name, built for a target as a `Runner` with
`generate(ids, cfg)`; the CLI, the benchmark and the reproduction know methods only through it.

Heads: an explicit path, else the trained heads shipped for the embedded target
(dart_lab/heads/<target>/{dart,eagle3}), else — only when asked with `random_heads=True`, for
plumbing tests — freshly initialised heads (correct but useless drafts; results say so).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import hub
from .engine.batch import BatchResult, generate_batch, hf_generate_batch
from .config import BudgetConfig
from .builders import BUILDERS
from .budget import BudgetController
from .config import GenerationConfig
from .draft_head import DartHead, Eagle3Head, HeadConfig
from .dart_ctx import ContextConfig, ContextDrafter
from .drafters import DartDrafter, Eagle3Drafter, Eagle3TreeConfig, PLDDrafter, SPSDrafter
from .errors import DartLabError
from .generate import Drafter, GenerationResult, generate, hf_generate
from .llamacpp import LlamaCpp, unavailable_reason as llamacpp_unavailable
from .loading import load_target
from .ngram import NGram, build_ngram
from .search import TreeSearchConfig
from .tree import Tree

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
    head_dtype: str = _opt("auto", "a loaded DART head's arithmetic: auto (on a CPU that packs bf16, the head's "
                                   "draft forward timed in the target's dtype and in bf16, the faster kept; "
                                   "random heads keep the target's) | target")
    tree_nodes: str = _opt("auto", "drafted tree nodes, root excluded: auto (chosen from this machine's measured "
                                   "verify cost and the head's acceptance, see budget.py) | paper (DART 60, "
                                   "EAGLE-3 59, the released defaults) | a number")
    tree_builder: str = _opt("dart", "what turns DART's levels into a tree (builders.py): dart (the released search) "
                                     "| best-first (DDTree's) | best-first-ngram | chain")


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
        return cls.load(hub.resolve(path, f"{kind} head {path}"), target=target)
    shipped = shipped_head(target, kind)
    if shipped is not None:
        return cls.load(shipped, target=target)
    if random_heads:
        return random_head(target, kind)
    raise DartLabError(f"no {kind} head for target {target.name!r}: pass --{kind}-head PATH "
                       f"(train one with `dart-lab train {kind}`) or --random-heads for a plumbing run")


def load_ngram_for(target, spec: str, max_tokens: int = 0):
    if spec.endswith((".npz", ".trie")):
        path = hub.resolve(spec, f"n-gram {spec}") if spec.startswith("hub:") else Path(spec)
        if not path.is_file():
            raise DartLabError(f"n-gram file not found: {spec}")
        return NGram.load(path, vocab_size=target.vocab_size)
    if target.tokenizer is None:
        raise DartLabError("building an n-gram table needs the target's tokenizer")
    return build_ngram(target.tokenizer, spec, max_tokens=max_tokens or None)


def _dart_head(target, opts: MethodOptions, cache: dict):
    if "dart_head" not in cache:
        if opts.head_dtype not in ("auto", "target"):
            raise DartLabError(f"--head-dtype must be auto or target, got {opts.head_dtype!r}")
        head = load_head(target, "dart", opts.dart_head, opts.random_heads)
        loaded = bool(opts.dart_head) or shipped_head(target, "dart") is not None
        cache["dart_head"] = fastest_head_dtype(target, head) if opts.head_dtype == "auto" and loaded else head
    head = cache["dart_head"]
    if opts.draft_length:
        head.cfg = dataclasses.replace(head.cfg, draft_length=opts.draft_length)
    return head


def fastest_head_dtype(target, head, min_gain: float = 1.1, repeats: int = 7):
    """The DART head in the arithmetic its draft forward runs fastest in here. A draft step's head forward is a
    small-M matmul chain whose weights (the 8k-row LM head most) stream from memory every step, so fewer bytes a
    weight pay: on a CPU that packs bf16 (oneDNN: AVX-512 or AMX) an fp32 head is timed as it drafts
    (`budget.head_forward_ms`) in fp32, in bf16 and, where our kernels build, with its linears on an 8-bit
    grid of the weights (`drafters.linears_in_8bit`), interleaved; the fastest is kept when it is `min_gain` x
    faster than fp32. What the head drafts moves only speed: the target verifies every token (lossless either
    way). Elsewhere, or slower: the head unchanged, its weights exact. `head.chosen_dtype` records the choice and
    every timing."""
    from .budget import head_forward_ms
    from .engine.head import dense_linears, linears_in_8bit
    from .engine.int4 import can_pack

    w = head.fc.weight
    if w.dtype != torch.float32 or not can_pack(w.device, torch.bfloat16):
        return head
    exact = {k: v.detach().clone() for k, v in head.state_dict().items()}

    def use(name: str) -> bool:
        dense_linears(head)
        if name == "bfloat16":
            head.to(torch.bfloat16)
            return True
        head.to(torch.float32)
        head.load_state_dict(exact)
        return name == "float32" or linears_in_8bit(head)

    names = [n for n in ("float32", "bfloat16", "q8") if use(n)]
    times = {n: [] for n in names}
    for _ in range(2):  # interleaved: a drifting host moves all alike
        for n in names:
            use(n)
            times[n].append(head_forward_ms(lambda: DartDrafter(head, None), target, 1, repeats))
    best = {n: min(v) for n, v in times.items()}
    fastest = min(names, key=lambda n: best[n])
    keep = fastest if best["float32"] >= min_gain * best[fastest] else "float32"
    use(keep)
    head.chosen_dtype = {"dtype": {"float32": "torch.float32", "bfloat16": "torch.bfloat16",
                                   "q8": "q8 (8-bit grid of the weights, our 8-bit kernel)"}[keep],
                         "draft_forward_ms": {n: round(v, 3) for n, v in best.items()}}
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
    if opts.tree_builder not in BUILDERS:
        raise DartLabError(f"--tree-builder must be one of {', '.join(BUILDERS)}, got {opts.tree_builder!r}")
    return TreeSearchConfig(**({"max_nodes": n} if n else {}), **{"builder": opts.tree_builder, **kw})


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


class Probe(Drafter):
    """The automatic budget's probe while a runner is in AR fallback (`BudgetConfig.fallback_probe_steps`):
    `drafter`'s trees for the first `steps` steps of an answer -- enough to see its acceptance by rank -- then
    what the fallback runs (`after`: the drafter without its tree, e.g. dart-ctx's copies; None: one-token
    steps). `drafter` observes every step, so its state follows the whole answer."""

    def __init__(self, drafter: Drafter, steps: int, after: Drafter | None):
        super().__init__()
        self.drafter, self.steps, self.after = drafter, steps, after
        self.name, self.needs_aux, self.proposed = drafter.name, drafter.needs_aux, 0

    def begin(self, target, ids, aux):
        self.proposed = 0
        self.drafter.begin(target, ids, aux)

    def propose(self, ids):
        self.proposed += 1
        by = self.drafter if self.proposed <= self.steps else self.after
        if by is None:
            self.last_timing = {}
            return Tree.single(ids[-1])
        by.last_timing = {}
        tree = by.propose(ids)
        self.last_timing = by.last_timing
        return tree

    def observe(self, ids, aux):
        self.drafter.observe(ids, aux)

    def config(self) -> dict:
        return self.drafter.config()


class Runner:
    """A decoding method bound to a target: `generate(ids, cfg) -> GenerationResult`.
    With an automatic tree budget its `controller` (budget.BudgetController) calibrates once when built,
    chooses theta for each request's context (when no theta beats AR: plain AR steps, or what the drafter
    can do without a tree, `Drafter.without_tree`) and learns from every generation."""

    def __init__(self, name: str, target, drafter: Drafter | None = None, hf: bool = False,
                 hf_lookup: int | None = None, auto_budget: bool = False, new_drafter: Callable | None = None,
                 refresh: bool = False, outside=None):
        self.name, self.target, self.drafter, self.hf, self.hf_lookup = name, target, drafter, hf, hf_lookup
        self.outside = outside  # another engine decoding the same target (llamacpp.LlamaCpp)
        self.new_drafter = new_drafter  # () -> another drafter of this method (the rows of a batch)
        self._row_drafters: list[Drafter] = []
        # refresh: measure again instead of reading the caches (`dart-lab calibrate`)
        self.controller = BudgetController(target, drafter, refresh=refresh, new_drafter=new_drafter) \
            if auto_budget and drafter is not None else None

    @property
    def budget(self) -> dict | None:
        """Greedy decoding's chosen tree budget (None without the automatic budget)."""
        return self.controller.budget if self.controller else None

    @property
    def budget_sampled(self) -> dict | None:
        return self.controller.budget_sampled if self.controller else None

    def generate(self, prompt_ids, cfg: GenerationConfig = GenerationConfig()) -> GenerationResult:
        if self.hf:
            return hf_generate(self.target, prompt_ids, cfg, prompt_lookup_num_tokens=self.hf_lookup)
        if self.outside is not None:
            return self.outside.generate(prompt_ids, cfg)
        sampled = not cfg.greedy
        budget = curve = None
        if self.controller is not None:
            budget, curve = self.controller.plan(len(prompt_ids), sampled, cfg.max_new_tokens)
        drafter = self.drafter
        if budget is not None and budget.get("probe", False):  # in fallback: a few steps with the best tree
            drafter = Probe(self.drafter, self.controller.cfg.fallback_probe_steps, self.controller.policy.without_tree(curve))
        elif budget is not None and budget["fallback_to_ar"]:
            drafter = self.controller.policy.without_tree(curve)
        res = generate(self.target, prompt_ids, drafter, cfg)
        res.method = self.name
        if budget is not None:
            self.controller.learn(res, budget, curve, sampled)
            res.config["tree_budget"] = {k: budget[k] for k in ("theta", "fallback_to_ar", "expected_speedup_vs_ar",
                                                                "context") + (("probe",) if "probe" in budget else ())}
        return res

    # -- batches (batch.py): one drafter per row, theta per live-row count
    def generate_batch(self, prompts, cfg: GenerationConfig = GenerationConfig(), max_rows: int | None = None
                       ) -> BatchResult:
        """Decode `prompts` together (`batch.generate_batch`; max_rows: at most that many at once, the
        others admitted as rows finish); row 0 drafts with this runner's drafter, the others with drafters
        of the same method (`new_drafter`), kept for later batches. With the automatic budget, theta is
        chosen for the batch's live rows (`BudgetController.batch_policy`)."""
        if self.hf:
            if max_rows and max_rows < len(prompts):
                raise DartLabError("HF generate decodes a static batch: no max_rows")
            return hf_generate_batch(self.target, prompts, cfg, self.hf_lookup, name=self.name)
        if self.outside is not None:
            raise DartLabError(f"{self.name} decodes one request at a time")
        drafters = None
        if self.drafter is not None:
            while len(self._row_drafters) < len(prompts) - 1:
                self._row_drafters.append(self.new_drafter())
            drafters = [self.drafter] + self._row_drafters[:len(prompts) - 1]
        policy = None
        if self.controller is not None:
            policy = self.controller.batch_policy(prompts, not cfg.greedy, cfg.max_new_tokens, drafters, max_rows)
        res = generate_batch(self.target, prompts, drafters, cfg, policy, name=self.name, max_rows=max_rows)
        if policy is not None:
            res.config["tree_budget_by_rows"] = {str(r): {k: ch[k] for k in ("theta", "expected_speedup_vs_ar",
                                                                            "fallback_to_ar")}
                                                 for r, ch in sorted(policy.chosen.items())}
        return res

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
    outside: Callable | None = None  # target -> an engine of its own with `generate(ids, cfg)` (llamacpp)
    batches: bool = True  # False: one request at a time only (the bench's batch sizes > 1 leave it out)
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
    Method("llamacpp", "llama.cpp on the embedded GGUF, plain greedy decoding (outside anchor; optional package)",
           samples=False, outside=LlamaCpp, batches=False),
)}


def unavailable_reason(name: str, target) -> str | None:
    """Why method `name` cannot run on `target` here (an optional package missing), or None."""
    return llamacpp_unavailable(target) if get_method(name).outside is LlamaCpp else None


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
    if m.outside is not None:
        return Runner(name, target, outside=m.outside(target))
    return Runner(name, target, make_drafter(name, target, opts, cache), hf=m.hf, hf_lookup=m.hf_lookup,
                  auto_budget=auto, new_drafter=lambda: make_drafter(name, target, opts, cache), refresh=refresh)
