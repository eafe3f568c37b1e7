"""Batched speculation: B requests decoded together, one target forward per step for all of them
(the setting of the paper's throughput tables, Tables 5-7).

Each step every live row drafts its own tree (its own drafter: DART's head and search, EAGLE-3's
tree, a copy, or the root alone), the trees are verified in ONE forward of B x N_max nodes (rows padded
to the step's largest tree; a pad node sees only itself, and the compact runner's 4-bit linears skip it), each
row accepts its own path and compacts its own cache, and a row that
finished leaves the batch (its cache rows are dropped, so it costs no more work). With `max_rows`
(continuous batching, as a server runs) a waiting request takes the finished row's place: waiting
requests are prefilled ahead, up to `max_rows` in one packed forward, and each joins as a place frees
(`BatchTarget.join` copies its cache in), so the batch stays full until the queue is empty.

Cache layout, shared by both runners (`BatchTarget`): row b holds `lens[b]` committed tokens in slots
[0, lens[b]); every step appends the nodes of all rows at the same slots [end, end + N_max) with
end = max(lens); slots [lens[b], end) of a shorter row are holes its mask hides. After acceptance row b's
path moves to [lens[b], lens[b] + k_b), and end becomes the new longest row. The same slots for every row
let the compact runner write K/V for the whole batch with one `index_copy_` per layer, and the
public-forward runner append to HF's `DynamicCache` as it always does; positions are explicit (rotary
position = lens[b] + depth), so a hole changes nothing but wasted attention over masked keys.

Lossless per row: in fp32 each row's tokens equal batch-1 AR on its prompt (tests/test_batch.py); at
T > 0 each row samples with its own generator seeded as batch-1 would, so a row is drawn from the
target's law exactly as alone.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from ..acceptance import accept, greedy_accept
from ..cost import copy_cap
from ..config import GenerationConfig
from ..errors import DartLabError
from ..policy import policy_for
from ..generate import Drafter, GenerationResult, _first_token, _margins, count_new_tokens, make_generator, top2
from ..target import Target, log_step, sync
from ..tree import Tree
from .batch_target import BatchOutput, BatchTarget


@dataclass
class BatchResult:
    """rows: one GenerationResult per prompt (in order; each row's prefill_s / decode_s are the batch's
    shared wall times); wall_s: the whole batch, prefill included (prefill_s: every prompt's, also those
    admitted while others decoded); steps: per batch step, the live rows, the largest tree, theta and the
    verify ms."""

    method: str
    rows: list[GenerationResult]
    prefill_s: float
    decode_s: float
    steps: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.rows)

    @property
    def batch_size(self) -> int:
        """Rows decoded at once (fewer than `rows` with continuous batching: `generate_batch(max_rows=)`)."""
        return self.config.get("batch_size", len(self.rows))

    @property
    def tokens_per_s(self) -> float:
        """All rows' new tokens over the batch's wall time."""
        return self.new_tokens / max(self.wall_s, 1e-9)

    def to_dict(self) -> dict:
        return {"method": self.method, "batch_size": self.batch_size, "requests": len(self.rows), "new_tokens": self.new_tokens,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s, "tokens_per_s": self.tokens_per_s,
                "steps": self.steps, "config": self.config, "rows": [r.to_dict() for r in self.rows]}


class _Row:
    """One request's state in the batch loop."""

    def __init__(self, prompt: torch.Tensor, drafter: Drafter, gen: torch.Generator):
        self.prompt, self.drafter, self.gen = prompt, drafter, gen
        self.ids: list[int] = []
        self.new: list[int] = []
        self.margins: list[float] = []
        self.steps: list[dict] = []
        self.stop = "max_new_tokens"


def _finished(row: _Row, emitted: list[int], lens: int, target: Target, cfg: GenerationConfig) -> bool:
    """The batch-1 loop's stop rule (generate.generate) for one row, after it emitted `emitted`."""
    if cfg.stop_on_eos and any(t in target.eos_ids for t in emitted):
        row.stop = "eos"
        return True
    if len(row.new) >= cfg.max_new_tokens:
        return True
    if lens + 1 >= target.max_context:
        row.stop = "context"
        return True
    return False


class _Chain(Drafter):
    """A theta-0 step's proposal for one row, decided for the whole batch (`_copy_step`): the row's copy
    chain cut to the step's cap, or the root alone."""

    def __init__(self, chain: list[int], draft_ms: float):
        super().__init__()
        self.chain, self.draft_ms = chain, draft_ms

    def propose(self, ids):
        self.last_timing = {"draft_ms": self.draft_ms, "search_ms": 0.0, **({"copy_only": True} if self.chain else {})}
        return Tree.from_paths(ids[-1], [self.chain]) if self.chain else Tree.single(ids[-1])


def _copy_step(rows: list, curve: dict[int, float]) -> list[Drafter]:
    """Theta 0 (no tree pays at this many rows): each row offers the chain its drafter would verify
    without a tree (`DraftPolicy.copy_offer`: dart-ctx's copy, else none) and one cap is chosen for the step
    (`cost.copy_cap` on the batch's curve): every row's tree is padded to the step's widest, so a copy
    runs only where the batch as a whole gains tokens per ms. Cap 0 = a batched AR step."""
    t0 = time.perf_counter()
    offers = [policy_for(row.drafter).copy_offer(row.ids) for row in rows]
    cap = copy_cap(offers, curve)
    ms = (time.perf_counter() - t0) * 1e3 / len(rows)
    return [_Chain(list(chain[:cap]), ms) for chain, _ in offers]


def _batched_head_forward(proposers: list[Drafter], ids: list[list[int]]) -> tuple[dict[int, torch.Tensor], float]:
    """Step 1's head forward, once for every row whose drafter wants one this step (`DraftPolicy.wants_head`),
    grouped by head and number of masks (`drafters.draft_logits_batch`). Returns {row: its logits} and
    the forward's ms per row (each row's draft_ms carries its share). A single such row drafts alone."""
    from ..drafters import draft_logits_batch

    want = [i for i, p in enumerate(proposers) if policy_for(p).wants_head(ids[i])]
    if len(want) < 2:
        return {}, 0.0
    t0 = time.perf_counter()
    groups: dict = {}
    for i in want:
        groups.setdefault((id(proposers[i].head), proposers[i].n_masks()), []).append(i)
    out = {}
    for rows in groups.values():
        out.update(zip(rows, draft_logits_batch([proposers[i] for i in rows])))
    return out, (time.perf_counter() - t0) * 1e3 / len(want)



@torch.no_grad()
def generate_batch(target: Target, prompts: list, drafters: list[Drafter] | None = None,
                   cfg: GenerationConfig = GenerationConfig(), policy=None, name: str | None = None,
                   max_rows: int | None = None) -> BatchResult:
    """Decode `prompts` (each (T_b,) token ids) together; drafters[b] drafts for row b (None: AR for all).

    max_rows: at most this many rows decode at once (continuous batching): the first max_rows prompts
    start, and each time rows finish the next waiting prompts join the batch (prefilled ahead, up to
    max_rows together: step 0), so the batch stays full until the queue is empty; None: all at once.
    policy (optional): live rows -> (theta, verify curve) from the automatic budget at that batch size
    (`methods.Runner.generate_batch`); theta 0 = no tree pays: batched AR steps, or copies where they pay
    for the batch (`_copy_step`), while every drafter keeps observing, so its state (the head's cache)
    stays whole. Steps: 0. admit, 1. draft, 2. verify (one forward), 3. accept, 4. compact."""
    B = len(prompts)
    drafters = drafters or [Drafter() for _ in range(B)]
    if len(drafters) != B:
        raise RuntimeError(f"{len(drafters)} drafters for {B} prompts")
    if max_rows is not None and max_rows < 1:
        raise DartLabError(f"max_rows must be >= 1, got {max_rows}")
    width = min(max_rows or B, B)
    prompts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    want_aux = any(d.needs_aux for d in drafters)
    rows = [_Row(p, d, make_generator(target.device, cfg.seed)) for p, d in zip(prompts, drafters)]
    bt = BatchTarget(target, rows_room=width)
    live: list[int] = []  # rows decoding, in the batch's row order
    admission = _Admission(target, rows, width, cfg, want_aux)
    theta = None
    t0 = time.perf_counter()
    prefill_s = 0.0
    batch_steps = []
    while live or admission.pending():
        if admission.pending() and len(live) < width:
            prefill_s += admission.admit(bt, live, theta)
            continue  # places still free (rows finished at their first token): admit again before a step
        if policy is not None:  # theta for this many live rows (re-chosen when rows finish)
            new_theta, curve = policy(len(live))
            if new_theta != theta:
                theta = new_theta
                for b in live:
                    if theta:
                        rows[b].drafter.set_budget(theta)
        proposers = ([rows[b].drafter for b in live] if policy is None or theta
                     else _copy_step([rows[b] for b in live], curve))
        still, record = _step(target, bt, [rows[b] for b in live], proposers, cfg, want_aux)
        batch_steps.append({**record, "theta": theta})
        bt.keep(still)  # 5. finished rows leave the batch (their places go to waiting prompts at step 0)
        live[:] = [live[i] for i in still]
    decode_s = time.perf_counter() - t0 - prefill_s
    results = [_row_result(row, target, cfg, name, prefill_s, decode_s) for row in rows]
    return BatchResult(method=name or drafters[0].name, rows=results, prefill_s=prefill_s, decode_s=decode_s,
                       steps=batch_steps, config={"generation": asdict(cfg), "batch_size": width,
                                                  "requests": B, "runner": getattr(target, "runner", "hf")})


def _step(target: Target, bt: "BatchTarget", live: list, proposers: list, cfg: GenerationConfig,
          want_aux: bool) -> tuple[list[int], dict]:
    """One batched step over the live rows: draft, verify, accept, compact (`generate_batch`'s steps 1-4).
    Returns the indices (into `live`) of the rows still decoding and the step's record."""
    dev = target.device
    # 1. draft: each live row proposes its tree (rooted at its last token)
    ta = time.perf_counter()
    trees = _draft(live, proposers, bt.lens, target.max_context)
    sync(dev)
    tb = time.perf_counter()
    # 2. verify: one target forward over every row's tree
    context = bt.end
    vo = bt.verify([tr for tr, _ in trees], want_aux=want_aux)
    sync(dev)
    tc = time.perf_counter()
    # 3. accept: each row's longest accepted path + bonus token, and its nodes' near-tie margins
    paths, margins = _accept([tr for tr, _ in trees], vo, cfg, [row.gen for row in live])
    # 4. compact each row's cache to its accepted path; hand the accepted states to its drafter
    bt.commit([p for p, _ in paths])
    still = []
    for i, row in enumerate(live):
        emitted = _advance(row, *trees[i], *paths[i], margins[i], vo.aux[i] if want_aux else None)
        if not _finished(row, emitted, bt.lens[i], target, cfg):
            still.append(i)
    sync(dev)
    td = time.perf_counter()
    record = {"rows": len(live), "max_tree": max(len(tr) for tr, _ in trees), "propose_ms": (tb - ta) * 1e3,
              "verify_ms": (tc - tb) * 1e3, "accept_ms": (td - tc) * 1e3}
    # what the budget prices: the step beyond drafting (verify, accept, compact), as the one-sequence loop logs
    log_step(target, len(live), record["max_tree"], (td - tb) * 1e3, context)
    return still, record


class _Admission:
    """`generate_batch`'s step 0: the prompts waiting, those prefilled ahead (`staged`) and waiting for a place
    (`queue`: (its row in `staged`, our row), in order)."""

    def __init__(self, target: Target, rows: list, width: int, cfg: GenerationConfig, want_aux: bool):
        self.target, self.rows, self.width, self.cfg, self.want_aux = target, rows, width, cfg, want_aux
        self.waiting = list(range(len(rows)))
        self.staged: BatchTarget | None = None
        self.queue: list[tuple[int, int]] = []

    def pending(self) -> bool:
        return bool(self.waiting or self.queue)

    def admit(self, bt: "BatchTarget", live: list[int], theta) -> float:
        """Fill the free places. When none is prefilled ahead, the next `width` waiting prompts are prefilled
        together (one packed forward: a prompt alone costs more than its share of a pack), each row's first new
        token taken (its first tree root) and its drafter begun; they join the batch as places free
        (`BatchTarget.join`: their K/V copied in). A row finished by its first token never joins.
        Returns the seconds it took."""
        target, cfg, dev = self.target, self.cfg, self.target.device
        sync(dev)
        t = time.perf_counter()
        if not self.queue:
            take = self.waiting[:self.width]
            del self.waiting[:len(take)]
            self.staged = BatchTarget(target)
            out = self.staged.prefill([self.rows[b].prompt for b in take], want_aux=self.want_aux)
            for j, b in enumerate(take):
                row = self.rows[b]
                first = _first_token(out.logits[j][-1], cfg, row.gen)
                row.ids, row.new, row.margins = row.prompt.tolist() + [first], [first], _margins(out.logits[j][-1:])
                row.drafter.begin(target, row.ids, out.aux[j] if self.want_aux else None)
                if not _finished(row, row.new, self.staged.lens[j], target, cfg):
                    self.queue.append((j, b))
        join = self.queue[:self.width - len(live)]
        del self.queue[:len(join)]
        bt.join(self.staged, [j for j, _ in join])
        for _, b in join:
            if theta:
                self.rows[b].drafter.set_budget(theta)
            live.append(b)
        sync(dev)
        return time.perf_counter() - t


def _draft(rows: list, proposers: list, lens: list[int], max_context: int) -> list[tuple[Tree, dict]]:
    """Step 1 for the live rows: each proposer's tree rooted at its row's last token (one batched head
    forward for the DART rows, its time shared out over them) and the proposer's timing."""
    from ..drafters import DartDrafter, propose_rows

    logits, shared_ms = _batched_head_forward(proposers, [row.ids for row in rows])
    # DART's rows (the plain drafter; dart-ctx adds per-row candidates) search together, grouped by what
    # their search depends on
    groups: dict = {}
    for i in logits:
        p = proposers[i]
        if type(p) is DartDrafter:
            groups.setdefault((id(p.head), id(p.ngram), p.search, p.eos, tuple(logits[i].shape)), []).append(i)
    searched = {}
    for group in (g for g in groups.values() if len(g) > 1):
        searched.update(zip(group, propose_rows([proposers[i] for i in group], [rows[i].ids for i in group],
                                                [logits[i] for i in group])))
    trees = []
    for i, (row, proposer) in enumerate(zip(rows, proposers)):
        if i in searched:  # its tree and timing already made by `propose_rows`
            tree = searched[i]
        else:
            proposer.last_timing = {}
            tree = proposer.propose(row.ids, logits[i]) if i in logits else proposer.propose(row.ids)
        if i in logits:
            proposer.last_timing["draft_ms"] = proposer.last_timing.get("draft_ms", 0.0) + shared_ms
        if int(tree.tokens[0]) != row.ids[-1]:
            raise RuntimeError(f"drafter {row.drafter.name} returned a tree whose root is not the last token")
        if lens[i] + int(tree.depths.max()) + 1 > max_context:
            tree = Tree.single(row.ids[-1])  # no room left for drafts: finish with plain AR steps
        trees.append((tree, proposer.last_timing))
    return trees


def _accept(trees: list[Tree], vo: BatchOutput, cfg: GenerationConfig, gens: list) -> tuple[list, list[list[float]]]:
    """Step 3 for the live rows: every node's argmax and near-tie margin in one pass over the flat logits and
    one copy to the host (`generate.top2`), then each row's (path, bonus) -- greedy: its longest path of
    argmaxes, else rejection sampling on its logits with its generator -- and its path's margins."""
    best, node_margins = top2(vo.flat)
    paths, margins, at = [], [], 0
    for tree, logits, gen in zip(trees, vo.logits, gens):
        n = len(tree)
        paths.append(greedy_accept(tree, best[at:at + n]) if cfg.greedy else accept(tree, logits, cfg, gen))
        margins.append([node_margins[at + i] for i in paths[-1][0]])
        at += n
    return paths, margins


def _advance(row: "_Row", tree: Tree, timing: dict, path: list[int], bonus: int, margins: list[float],
             aux: torch.Tensor | None) -> list[int]:
    """Step 4 for one row after its cache was compacted: the accepted tokens + bonus appended, the
    accepted states handed to its drafter, the step recorded. Returns the emitted tokens."""
    emitted = tree.tokens[path[1:]].tolist() + [bonus]
    row.ids.extend(emitted)
    row.new.extend(emitted)
    row.margins.extend(margins)
    row.drafter.observe(row.ids, aux[path] if aux is not None else None)
    row.steps.append({"accept_len": len(path) - 1, "tree_size": len(tree),
                      **({"path_ranks": tree.ranks[path[1:]].tolist()} if tree.ranks is not None else {}),
                      "draft_ms": timing.get("draft_ms", 0.0), "search_ms": timing.get("search_ms", 0.0),
                      **({"copy_only": True} if timing.get("copy_only") else {})})
    return emitted


def _row_result(row: "_Row", target: Target, cfg: GenerationConfig, name: str | None, prefill_s: float,
                decode_s: float) -> GenerationResult:
    """One row's GenerationResult, counted as every method's (`count_new_tokens`); the batch's times."""
    new = count_new_tokens(row.new, target, cfg)
    return GenerationResult(method=name or row.drafter.name, tokens=new, prompt_tokens=row.prompt.numel(),
                            prefill_s=prefill_s, decode_s=decode_s, stop_reason=row.stop, steps=row.steps,
                            margins=row.margins[:len(new)],
                            config={"generation": asdict(cfg), "drafter": row.drafter.config()},
                            text=target.decode(new) if target.tokenizer is not None else "")


@torch.no_grad()
def hf_generate_batch(target: Target, prompts: list, cfg: GenerationConfig = GenerationConfig(),
                      prompt_lookup_num_tokens: int | None = None, name: str | None = None) -> BatchResult:
    """External reference: Hugging Face `generate` on the prompts left-padded into one batch (attention
    mask over the padding), each row counted as `generate.hf_generate` counts. HF does not separate
    prefill from decode, so all time is decode_s. Prompt lookup (hf-pld) runs one row at a time in HF."""
    from ..generate import hf_generate

    prompts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if any(p.numel() == 0 for p in prompts):
        raise DartLabError("prompt is empty")
    if prompt_lookup_num_tokens:  # HF's prompt lookup refuses batches: rows one after another
        t0 = time.perf_counter()
        rows = [hf_generate(target, p, cfg, prompt_lookup_num_tokens) for p in prompts]
        wall = time.perf_counter() - t0
    else:
        torch.manual_seed(cfg.seed)
        pad = min(target.eos_ids) if target.eos_ids else 0
        T = max(p.numel() for p in prompts)
        x = torch.full((len(prompts), T), pad, dtype=torch.long)
        mask = torch.zeros(len(prompts), T, dtype=torch.long)
        for b, p in enumerate(prompts):
            x[b, T - p.numel():], mask[b, T - p.numel():] = p, 1
        kw = dict(max_new_tokens=cfg.max_new_tokens, do_sample=not cfg.greedy, pad_token_id=pad,
                  eos_token_id=sorted(target.eos_ids) if cfg.stop_on_eos else None)
        kw.update(dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None) if not cfg.greedy
                  else dict(temperature=None, top_p=None, top_k=None))
        dev = target.device
        sync(dev)
        t0 = time.perf_counter()
        out = target.model.generate(x.to(dev), attention_mask=mask.to(dev), **kw)
        sync(dev)
        wall = time.perf_counter() - t0
        rows = []
        for b, p in enumerate(prompts):
            new = count_new_tokens(out[b, T:].tolist(), target, cfg)
            rows.append(GenerationResult(method="hf", tokens=new, prompt_tokens=p.numel(), prefill_s=0.0, decode_s=wall,
                                         stop_reason="eos" if new and new[-1] in target.eos_ids else "max_new_tokens",
                                         config={"generation": asdict(cfg)},
                                         text=target.decode(new) if target.tokenizer is not None else ""))
    return BatchResult(method=name or ("hf-pld" if prompt_lookup_num_tokens else "hf"), rows=rows, prefill_s=0.0,
                       decode_s=wall, config={"generation": asdict(cfg), "batch_size": len(prompts), "runner": "hf"})
