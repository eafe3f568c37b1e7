"""The decode loop shared by every method: draft -> tree -> verify -> accept -> compact cache.

Autoregressive decoding is the same loop with a drafter that proposes the one-node tree, so AR and
speculative methods share prefill, sampling, stop rule and token counting.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from . import fast
from .config import GenerationConfig
from .errors import DartLabError
from .target import ONE_SEQUENCE, Target, log_step, sync
from .tree import Tree
from .acceptance import accept, greedy_accept, sample_token, target_probs


class Drafter:
    """Interface of a drafting method. The base class is plain AR: it proposes the root alone.

    begin(target, ids, aux):  after prefill; ids = prompt + first new token (the first root),
                              aux = (T, 3H) aux hidden states of the prompt (if needs_aux).
    propose(ids) -> Tree:     the tree to verify; its root must be ids[-1]. May set
                              `self.last_timing = {"draft_ms": .., "search_ms": ..}` (and
                              "copy_only": True for a step that skipped its head, dart-ctx).
    observe(ids, aux):        after acceptance; ids = all tokens so far (new root last),
                              aux = (k+1, 3H) aux states of the accepted nodes (root first).
    What the tree budget and a batch ask beyond these is the drafter's policy (policy.py).
    """

    name = "ar"
    needs_aux = False
    def __init__(self) -> None:
        self.last_timing: dict = {}

    def begin(self, target: Target, ids: list[int], aux: torch.Tensor | None) -> None:
        pass

    def propose(self, ids: list[int]) -> Tree:
        return Tree.single(ids[-1])

    def observe(self, ids: list[int], aux: torch.Tensor | None) -> None:
        pass

    def config(self) -> dict:
        return {"name": self.name}


@dataclass
class GenerationResult:
    """tokens: the new token ids (EOS included when hit), counted the same way for every method."""

    method: str
    tokens: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    stop_reason: str
    steps: list[dict] = field(default_factory=list)  # per verify step: accept_len, draft/search/verify ms
    # the target's top-1 minus top-2 logit where each token was chosen (aligned with tokens): how
    # close a call it was, which is what a low-precision divergence from AR is judged by
    margins: list[float] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    text: str = ""

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.total_s, 1e-9)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step, bonus token included (1.0 for AR)."""
        return sum(s["accept_len"] + 1 for s in self.steps) / max(len(self.steps), 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(new_tokens=self.new_tokens, tokens_per_s=self.tokens_per_s, tau=self.tau)
        return d


def _first_token(logits_row: torch.Tensor, cfg: GenerationConfig, gen: torch.Generator) -> int:
    if cfg.greedy:
        return int(logits_row.argmax())
    return sample_token(target_probs(logits_row[None], cfg)[0], gen)


def _margins(logits: torch.Tensor) -> list[float]:
    """(k, V) -> top-1 minus top-2 logit of each row."""
    return top2(logits)[1]


def top2(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """(k, V) -> each row's argmax (its first maximum, as `greedy_accept` takes it) and its top-1 minus top-2
    logit (the near-tie record): torch's max and topk(2), or the engine's one pass over fp32 CPU logits (`fast`)."""
    out = fast.call("top2", logits)  # the engine's one pass, where it runs
    values, index = out if out is not None else (torch.topk(logits.float(), 2, dim=-1).values, logits.max(-1).indices)
    return index.tolist(), (values[:, 0] - values[:, 1]).tolist()


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def count_new_tokens(new: list[int], target: Target, cfg: GenerationConfig) -> list[int]:
    """The same counting for every method (and every row of a batch): cut at max_new_tokens, then
    after the first EOS."""
    new = new[:cfg.max_new_tokens]
    if cfg.stop_on_eos:
        for i, t in enumerate(new):
            if t in target.eos_ids:
                return new[:i + 1]
    return new


def _stop_reason(emitted: list[int], new: list[int], target: Target, cfg: GenerationConfig) -> str | None:
    """Why decoding stops before the next step (an EOS among the tokens just emitted, max_new_tokens reached, the
    context full), or None."""
    if cfg.stop_on_eos and any(t in target.eos_ids for t in emitted):
        return "eos"
    if len(new) >= cfg.max_new_tokens:
        return "max_new_tokens"
    if target.seq_len + 1 >= target.max_context:
        return "context"
    return None


def _step_record(tree: Tree, path: list[int], timing: dict, propose_ms: float, verify_ms: float) -> dict:
    """One verify step as `GenerationResult.steps` records it: accepted length, tree size, the accepted nodes'
    ranks (what the budget's tau(theta) is measured from), the drafter's timings and the step's."""
    return {"accept_len": len(path) - 1, "tree_size": len(tree),
            **({"path_ranks": tree.ranks[path[1:]].tolist()} if tree.ranks is not None else {}),
            "draft_ms": timing.get("draft_ms", 0.0), "search_ms": timing.get("search_ms", 0.0),
            "propose_ms": propose_ms, "verify_ms": verify_ms, **({"copy_only": True} if timing.get("copy_only") else {})}


@torch.no_grad()
def generate(target: Target, prompt_ids, drafter: Drafter | None = None,
             cfg: GenerationConfig = GenerationConfig()) -> GenerationResult:
    """Generate up to cfg.max_new_tokens after prompt_ids (T,) with `drafter` (None = AR)."""
    drafter = drafter or Drafter()
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    dev = target.device
    gen = make_generator(dev, cfg.seed)

    # 0. prefill: cache the prompt and pick the first new token (the first tree root)
    sync(dev)
    t0 = time.perf_counter()
    out = target.prefill(prompt_ids, want_aux=drafter.needs_aux, all_logits=False)
    first = _first_token(out.logits[-1], cfg, gen)
    ids = prompt_ids.tolist() + [first]
    new, emitted = [first], [first]
    margins = _margins(out.logits[-1:])
    drafter.begin(target, ids, out.aux)
    sync(dev)
    t1 = time.perf_counter()

    steps = []
    while (stop := _stop_reason(emitted, new, target, cfg)) is None:
        # 1. draft: the drafter proposes a tree rooted at the last token
        ta = time.perf_counter()
        drafter.last_timing = {}
        tree = drafter.propose(ids)
        if int(tree.tokens[0]) != ids[-1]:
            raise RuntimeError(f"drafter {drafter.name} returned a tree whose root is not the last token")
        if target.seq_len + int(tree.depths.max()) + 1 > target.max_context:
            tree = Tree.single(ids[-1])  # no room left for drafts: finish with plain AR steps
        sync(dev)
        tb = time.perf_counter()
        # 2. verify: one target forward over the whole tree
        context = target.seq_len
        vo = target.verify(tree, want_aux=drafter.needs_aux)
        # 3. accept: longest accepted path + bonus token (greedy or rejection sampling); every node's argmax and
        # near-tie margin in one pass over the logits
        best, node_margins = top2(vo.logits)
        path, bonus = greedy_accept(tree, best) if cfg.greedy else accept(tree, vo.logits, cfg, gen)
        # 4. compact the cache to the accepted path, hand the accepted states to the drafter
        target.commit(path)
        emitted = tree.tokens[path[1:]].tolist() + [bonus]
        ids.extend(emitted)
        new.extend(emitted)
        margins.extend(node_margins[i] for i in path)
        drafter.observe(ids, vo.aux[path] if vo.aux is not None else None)
        sync(dev)
        tc = time.perf_counter()
        steps.append(_step_record(tree, path, drafter.last_timing, (tb - ta) * 1e3, (tc - tb) * 1e3))
        log_step(target, ONE_SEQUENCE, len(tree), steps[-1]["verify_ms"], context)  # what the budget prices
    t2 = time.perf_counter()

    new = count_new_tokens(new, target, cfg)
    margins = margins[:len(new)]
    text = target.decode(new) if target.tokenizer is not None else ""
    return GenerationResult(method=drafter.name, tokens=new, prompt_tokens=prompt_ids.numel(), prefill_s=t1 - t0,
                            decode_s=t2 - t1, stop_reason=stop, steps=steps, margins=margins,
                            config={"generation": asdict(cfg), "drafter": drafter.config()}, text=text)


@torch.no_grad()
def hf_generate(target: Target, prompt_ids, cfg: GenerationConfig = GenerationConfig(),
                prompt_lookup_num_tokens: int | None = None) -> GenerationResult:
    """External reference: Hugging Face `generate` on the same prompt, counted the same way.

    prompt_lookup_num_tokens set -> HF's prompt lookup decoding ("hf-pld"). HF does not separate
    prefill from decode, so all time is reported as decode_s.
    """
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if prompt_ids.numel() == 0:
        raise DartLabError("prompt is empty")
    torch.manual_seed(cfg.seed)
    kw = dict(max_new_tokens=cfg.max_new_tokens, do_sample=not cfg.greedy,
              eos_token_id=sorted(target.eos_ids) if cfg.stop_on_eos else None,
              pad_token_id=min(target.eos_ids) if target.eos_ids else 0)
    if not cfg.greedy:
        kw.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    if prompt_lookup_num_tokens:
        kw["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    dev = target.device
    x = prompt_ids[None].to(dev)
    sync(dev)
    t0 = time.perf_counter()
    out = target.model.generate(x, attention_mask=torch.ones_like(x), **kw)
    sync(dev)
    t1 = time.perf_counter()
    new = count_new_tokens(out[0, prompt_ids.numel():].tolist(), target, cfg)
    name = "hf-pld" if prompt_lookup_num_tokens else "hf"
    text = target.decode(new) if target.tokenizer is not None else ""
    return GenerationResult(method=name, tokens=new, prompt_tokens=prompt_ids.numel(), prefill_s=0.0, decode_s=t1 - t0,
                            stop_reason="eos" if new and new[-1] in target.eos_ids else "max_new_tokens",
                            config={"generation": asdict(cfg), "hf": {k: v for k, v in kw.items() if k != "eos_token_id"}},
                            text=text)
