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

from . import kernels
from ..acceptance import accept, greedy_accept
from ..budget import copy_cap, log_step
from ..config import GenerationConfig
from ..errors import DartLabError
from ..generate import Drafter, GenerationResult, _first_token, _margins, count_new_tokens, make_generator, top2
from ..target import Target, sync
from ..tree import Tree


@dataclass
class BatchOutput:
    """logits: per row, (N_b, V) float32 (prefill: (1, V), the last prompt token's);
    aux: per row, (N_b, 3H) (prefill: (T_b, 3H)), or None."""

    logits: list[torch.Tensor]
    aux: list[torch.Tensor] | None = None
    flat: torch.Tensor | None = None  # verify: every row's logits as one (sum N_b, V) tensor (logits are its views)


class BatchTarget:
    """B sequences over one `Target`'s weights: `prefill(prompts)`, then `verify(trees)` / `commit(paths)`
    per step, and `keep(rows)` when rows finish. The compact runner (`engine.runner`) keeps a static K/V
    cache (L, B, kv_heads, capacity, head_dim); the public-forward runner its `DynamicCache` with a 4D
    additive mask. The single-sequence `Target` is left untouched (its own cache)."""

    def __init__(self, target: Target, capacity_step: int = 256, pack_tokens: int = 2048, rows_room: int = 0):
        self.target, self.capacity_step, self.pack_tokens = target, capacity_step, pack_tokens
        self.fast = getattr(target, "runner", "hf") == "fast"
        self.lens: list[int] = []
        self.end = 0
        # fast runner: (L, B, kv, cap, hd), the first B rows of a store of max(B, rows_room) rows, so rows that
        # join later (`join`) are copied into place instead of the whole cache reallocated
        self._k = self._v = None
        self._store: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rows_room = rows_room
        self.cache = None  # public forward: DynamicCache

    @property
    def batch_size(self) -> int:
        return len(self.lens)

    @property
    def _mask_dtype(self) -> torch.dtype:
        return self.target.attention_dtype if self.fast else self.target.dtype

    # -- masks
    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """(B, N, K) bool -> (B, 1, N, K) additive mask in the attention dtype."""
        dt = self._mask_dtype
        low = float("-inf") if self.fast else torch.finfo(dt).min
        return torch.zeros(allowed.shape, dtype=dt).masked_fill_(~allowed, low)[:, None].to(self.target.device)

    # -- forward
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, rows: torch.Tensor,
                 want_aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions (B, N); allowed (B, N, end + N) bool; rows: flat indices into B * N whose logits
        are wanted (fast runner: a step's real nodes, the others pads the linears skip). Returns logits
        (len(rows), V) fp32 and aux (B, N, 3H) or None."""
        t, dev = self.target, self.target.device
        B, N = ids.shape
        if self.fast:
            from .step import decoder_step

            self._ensure(self.end + N)
            slots = torch.arange(self.end, self.end + N, device=dev)
            caches = (list(self._k.unbind(0)), list(self._v.unbind(0)))
            logits, aux = decoder_step(t.model, *t.projections(), t._geometry(), ids.to(dev),
                                       positions.to(dev), slots, caches, self.end + N, self._additive(allowed),
                                       rows=(rows := rows.to(dev)), live=rows)
            return logits, aux if want_aux else None
        out = t.model(input_ids=ids.to(dev), position_ids=positions.to(dev), attention_mask=self._additive(allowed),
                      use_cache=True, output_hidden_states=want_aux, **{t._cache_kw: self.cache})
        logits = out.logits.reshape(B * N, -1)[rows.to(dev)].float()
        aux = torch.cat([out.hidden_states[i] for i in t.aux_layers], dim=-1) if want_aux else None
        return logits, aux

    def _ensure(self, n: int) -> None:
        """Fast runner: cache capacity for n slots per row (contents kept)."""
        if self._k is None or self._k.shape[3] < n:
            self._alloc(self.batch_size, n)

    def _alloc(self, rows: int, n: int) -> None:
        """Fast runner: a new store for `rows` rows (room for `rows_room`) of at least n slots, the current
        rows' filled slots copied in. Unfilled slots are left as allocated: a step writes its slots before
        reading them, and the holes a mask hides are zeroed where rows enter (`_zero_holes`)."""
        t = self.target
        t.attention_nodes  # measured before the first step with this cache (not inside a compiled graph)
        cap = min(n + self.capacity_step, max(t.max_context + 64, n))
        shape = (t.num_layers, max(rows, self.rows_room), t.n_kv, cap, t.head_dim)
        k = torch.empty(shape, dtype=t.cache_dtype, device=t.device)
        v = torch.empty(shape, dtype=t.cache_dtype, device=t.device)
        if self._k is not None and self.end:
            B = self._k.shape[1]
            k[:, :B, :, :self.end] = self._k[:, :, :, :self.end]
            v[:, :B, :, :self.end] = self._v[:, :, :, :self.end]
        self._store = (k, v)
        self._k, self._v = k[:, :rows], v[:, :rows]

    def _zero_holes(self, rows) -> None:
        """Fast runner: rows' slots [lens[b], end) -- read under a -inf mask, never written -- set to zero, so
        a hole holds no NaN from fresh memory (0 x NaN would reach the output)."""
        for b in rows:
            if self.lens[b] < self.end:
                self._k[:, b, :, self.lens[b]:self.end] = 0
                self._v[:, b, :, self.lens[b]:self.end] = 0

    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor], want_aux: bool = False) -> BatchOutput:
        """Run B prompts (each (T_b,)) right-padded to the longest, each causally over its own tokens."""
        t = self.target
        if not prompts:
            raise DartLabError("no prompts to decode")
        prompts = [t.check_prompt(p) for p in prompts]
        B, T = len(prompts), max(p.numel() for p in prompts)
        lens = torch.tensor([p.numel() for p in prompts])
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, :p.numel()] = p
        positions = torch.arange(T).expand(B, T)
        q, k = torch.arange(T)[:, None], torch.arange(T)[None]
        # causal over the row's own tokens; a pad position sees itself only (no all-masked softmax row)
        allowed = (k <= q) & ((k < lens[:, None, None]) | (k == q))
        self.lens, self.end = [0] * B, 0
        self._k = self._v = None
        if self.fast:  # row by row into the batch's cache: no compute spent on padding
            return self._prefill_rows(prompts, T, want_aux)
        from transformers import DynamicCache

        self.cache = DynamicCache(config=t.model.config)
        logits, aux = self._forward(ids, positions, allowed, torch.arange(B) * T + lens - 1, want_aux)
        self.lens, self.end = lens.tolist(), T
        return BatchOutput(list(logits[:, None]), [aux[b, :n] for b, n in enumerate(self.lens)] if want_aux else None)

    def _prefill_rows(self, prompts: list[torch.Tensor], T: int, want_aux: bool) -> BatchOutput:
        """Fast runner: the prompts packed end to end through the decoder (`decoder_step`'s segments:
        each causal over its own tokens, written into its row of the cache), at most `pack_tokens` a
        forward; no compute is spent on padding, and the linears see every prompt's tokens at once."""
        from .step import decoder_step

        t, dev = self.target, self.target.device
        self.lens = [0] * len(prompts)
        self._ensure(T)
        logits, aux, first = [], [], 0
        for group in _packs([p.numel() for p in prompts], self.pack_tokens):
            ends = torch.tensor(group).cumsum(0)
            segments = list(zip([0] + ends[:-1].tolist(), ends.tolist()))
            ids = torch.cat(prompts[first:first + len(group)]).to(dev)
            positions = torch.cat([torch.arange(n) for n in group]).to(dev)
            caches = ([k[first:first + len(group)] for k in self._k.unbind(0)],
                      [v[first:first + len(group)] for v in self._v.unbind(0)])
            lg, ax = decoder_step(t.model, *t.projections(prefill=True), t._geometry(), ids, positions,
                                  None, caches, int(ends[-1]), None, causal=True, rows=(ends - 1).to(dev),
                                  segments=segments)
            logits.extend(lg[:, None].unbind(0))
            aux.extend(ax[s:e] for s, e in segments)
            first += len(group)
        self.lens, self.end = [p.numel() for p in prompts], T
        self._zero_holes(range(len(prompts)))
        return BatchOutput(logits, aux if want_aux else None)

    @torch.no_grad()
    def verify(self, trees: list[Tree], want_aux: bool = False) -> BatchOutput:
        """One forward over every row's tree (row b's node i at position lens[b] + depth[i], attending to
        the row's committed tokens and its own ancestors); must be followed by `commit`."""
        if len(trees) != self.batch_size:
            raise RuntimeError(f"{len(trees)} trees for a batch of {self.batch_size}")
        B, N, P = len(trees), max(len(tr) for tr in trees), self.end
        lens = torch.tensor(self.lens)
        if N == 1:  # one node a row (AR steps; theta 0 without copies): no tree to lay out row by row
            ids = torch.tensor([[int(tr.tokens[0])] for tr in trees])
            positions = lens[:, None]
            allowed = torch.empty(B, 1, P + 1, dtype=torch.bool)
            allowed[:, 0, :P] = torch.arange(P)[None] < lens[:, None]
            allowed[:, 0, P] = True
            logits, aux = self._forward(ids, positions, allowed, torch.arange(B), want_aux)
            self._pending = 1
            return BatchOutput(list(logits[:, None].unbind(0)), list(aux.unbind(0)) if want_aux else None,
                               flat=logits)
        sizes = torch.tensor([len(tr) for tr in trees])
        ids = torch.zeros(B, N, dtype=torch.long)
        positions = lens[:, None].repeat(1, N)
        allowed = torch.zeros(B, N, P + N, dtype=torch.bool)
        allowed[:, :, :P] = torch.arange(P)[None, None] < lens[:, None, None]
        allowed[:, :, P:] = torch.eye(N, dtype=torch.bool)  # pad nodes: themselves only
        for b, tr in enumerate(trees):
            n = len(tr)
            ids[b, :n] = tr.tokens
            positions[b, :n] += tr.depths
            allowed[b, :n, P:P + n] = tr.ancestor_mask()
            allowed[b, n:, :P] = False  # a pad node sees itself only: our attention kernel then skips it
        rows = (torch.arange(B)[:, None] * N + torch.arange(N)[None])[torch.arange(N)[None] < sizes[:, None]]
        logits, aux = self._forward(ids, positions, allowed, rows, want_aux)
        self._pending = N
        return BatchOutput(list(logits.split(sizes.tolist())),
                           [aux[b, :n] for b, n in enumerate(sizes.tolist())] if want_aux else None, flat=logits)

    def commit(self, paths: list[list[int]]) -> None:
        """Row b keeps the K/V of its accepted nodes `paths[b]` (root first) at [lens[b], lens[b] + k_b)."""
        P = self.end
        moves = []  # (row, source slots, first destination slot), as Python ints: a batch step makes one tensor
        for b, path in enumerate(paths):
            path = [int(i) for i in path]
            if not path or path[0] != 0:
                raise RuntimeError("an accepted path starts at the root (node 0)")
            if not (self.lens[b] == P and path == list(range(len(path)))):  # else already in place
                moves.append((b, [P + i for i in path], self.lens[b]))
            self.lens[b] += len(path)
        if self.fast and moves and self._k.device.type == "cpu" and kernels.move_slots_here():  # plain copies
            torch.ops.dart_lab.move_slots(self._k, self._v, [b for b, src, _ in moves for _ in src],
                                          [i for _, src, _ in moves for i in src],
                                          [at + j for _, src, at in moves for j in range(len(src))])
        elif self.fast and moves:  # every row's moves as one gather (advanced indexing copies) and one write
            dev = self.target.device
            row = torch.tensor([b for b, src, _ in moves for _ in src], device=dev)
            src = torch.tensor([i for _, src, _ in moves for i in src], device=dev)
            dst = torch.tensor([at + j for _, src, at in moves for j in range(len(src))], device=dev)
            self._k[:, row, :, dst] = self._k[:, row, :, src]
            self._v[:, row, :, dst] = self._v[:, row, :, src]
        elif not self.fast:
            moves = [(b, torch.tensor(src, device=self.target.device), at) for b, src, at in moves]  # once, not per layer
            for layer in self.cache.layers:
                keys, values = layer.keys, layer.values
                for b, src, at in moves:
                    keys[b, :, at:at + len(src)] = keys[b, :, src]
                    values[b, :, at:at + len(src)] = values[b, :, src]
        self.end = max(self.lens)
        if not self.fast:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., :self.end, :], layer.values[..., :self.end, :]
        self._pending = 0

    @torch.no_grad()
    def join(self, other: "BatchTarget", rows: list[int]) -> None:
        """Append `other`'s rows `rows` (indices into its batch, e.g. prompts prefilled ahead of time) after
        this batch's rows (continuous batching: a finished row's place goes to a waiting request). The fast
        runner copies each row's filled slots into its store (room kept for `rows_room` rows); the public
        forward joins the caches along the batch, the shorter padded with slots the masks hide (each row
        attends to its own [0, lens[b]) only)."""
        if not rows:
            return
        n, lens = self.batch_size, self.lens + [other.lens[r] for r in rows]
        end = max(lens)
        if self.fast and not self.lens and rows == list(range(other.batch_size)):
            self._k, self._v, self._store = other._k, other._v, other._store  # all of other's rows: its cache as is
        elif self.fast:
            if self._store is None or self._store[0].shape[1] < len(lens) or self._store[0].shape[3] < end:
                self.rows_room = max(self.rows_room, len(lens))
                self._alloc(n, end)
            k, v = self._store
            self._k, self._v = k[:, :len(lens)], v[:, :len(lens)]
            for j, r in enumerate(rows):
                m = other.lens[r]
                self._k[:, n + j, :, :m] = other._k[:, r, :, :m]
                self._v[:, n + j, :, :m] = other._v[:, r, :, :m]
        else:  # DynamicCache layers: (B, kv, slots, hd)
            sel = torch.as_tensor(rows, dtype=torch.long, device=self.target.device)
            if not self.lens:  # a cache of its own (other's may still hand out its other rows)
                from transformers import DynamicCache

                self.cache = DynamicCache(config=self.target.model.config)
                for i, layer in enumerate(other.cache.layers):
                    self.cache.update(layer.keys.index_select(0, sel), layer.values.index_select(0, sel), i)
            else:
                def joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                    """a and b's selected rows, padded to the same number of slots, stacked along the batch."""
                    b = b.index_select(0, sel)
                    s = max(a.shape[2], b.shape[2])
                    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, s - x.shape[2]))  # noqa: E731
                    return torch.cat([pad(a), pad(b)], 0)

                for lo, ln in zip(self.cache.layers, other.cache.layers):
                    lo.keys, lo.values = joined(lo.keys, ln.keys), joined(lo.values, ln.values)
            for layer in self.cache.layers:  # slots past the longest row's are never read (commit trims so too)
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        self.lens, self.end = lens, end
        if self.fast:  # the joined rows' holes, and the existing rows' new ones where the end moved
            self._zero_holes(range(len(lens)))

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the current batch), in that order: finished rows cost no more."""
        if rows == list(range(self.batch_size)):
            return
        self.lens = [self.lens[r] for r in rows]
        self.end = max(self.lens, default=0)
        sel = torch.as_tensor(rows, dtype=torch.long, device=self.target.device)
        if self.fast and all(a < b for a, b in zip(rows, rows[1:])):
            # rows only move up (row i <- rows[i] >= i), so in place: only the moved rows' filled slots are
            # copied, and the cache keeps its capacity as a view of its first len(rows) rows
            for i, (r, n) in enumerate(zip(rows, self.lens)):
                if r != i:
                    self._k[:, i, :, :n] = self._k[:, r, :, :n]
                    self._v[:, i, :, :n] = self._v[:, r, :, :n]
            self._k, self._v = self._k[:, :len(rows)], self._v[:, :len(rows)]
        elif self.fast:
            self._k, self._v = self._k.index_select(1, sel), self._v.index_select(1, sel)
            self._store = (self._k, self._v)
        else:
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(0, sel)[..., :self.end, :]
                layer.values = layer.values.index_select(0, sel)[..., :self.end, :]

    def truncate(self, n: int) -> None:
        """Every row back to its first n tokens (timing loops)."""
        self.lens, self.end = [n] * self.batch_size, n
        if not self.fast:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]


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
    without a tree (`Drafter.copy_offer`: dart-ctx's copy, else none) and one cap is chosen for the step
    (`budget.copy_cap` on the batch's curve): every row's tree is padded to the step's widest, so a copy
    runs only where the batch as a whole gains tokens per ms. Cap 0 = a batched AR step."""
    t0 = time.perf_counter()
    offers = [row.drafter.copy_offer(row.ids) for row in rows]
    cap = copy_cap(offers, curve)
    ms = (time.perf_counter() - t0) * 1e3 / len(rows)
    return [_Chain(list(chain[:cap]), ms) for chain, _ in offers]


def _batched_head_forward(proposers: list[Drafter], ids: list[list[int]]) -> tuple[dict[int, torch.Tensor], float]:
    """Step 1's head forward, once for every row whose drafter wants one this step (`Drafter.wants_head`),
    grouped by head and number of masks (`drafters.draft_logits_batch`). Returns {row: its logits} and
    the forward's ms per row (each row's draft_ms carries its share). A single such row drafts alone."""
    from ..drafters import draft_logits_batch

    want = [i for i, p in enumerate(proposers) if p.wants_head(ids[i])]
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


def _packs(lengths: list[int], most: int) -> list[list[int]]:
    """Consecutive prompt lengths grouped so a group's tokens stay within `most` (a longer prompt alone)."""
    groups: list[list[int]] = []
    for n in lengths:
        if groups and sum(groups[-1]) + n <= most:
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups


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
    dev = target.device
    want_aux = any(d.needs_aux for d in drafters)
    rows = [_Row(p, d, make_generator(dev, cfg.seed)) for p, d in zip(prompts, drafters)]
    bt = BatchTarget(target, rows_room=width)
    live: list[int] = []  # rows decoding, in the batch's row order
    waiting = list(range(B))
    staged: BatchTarget | None = None  # the prompts prefilled ahead
    queue: list[tuple[int, int]] = []  # (its row, our row) of those waiting for a place, in order
    theta = None

    def admit() -> float:
        """Step 0: fill the free places. When none is prefilled ahead, the next `width` waiting prompts are
        prefilled together (one packed forward: a prompt alone costs more than its share of a pack), each
        row's first new token taken (its first tree root) and its drafter begun; they join the batch as places
        free (`BatchTarget.join`: their K/V copied in). A row finished by its first token never joins.
        Returns the seconds it took."""
        nonlocal staged
        sync(dev)
        t = time.perf_counter()
        if not queue:
            take = waiting[:width]
            del waiting[:len(take)]
            staged = BatchTarget(target)
            out = staged.prefill([rows[b].prompt for b in take], want_aux=want_aux)
            for j, b in enumerate(take):
                row = rows[b]
                first = _first_token(out.logits[j][-1], cfg, row.gen)
                row.ids, row.new, row.margins = row.prompt.tolist() + [first], [first], _margins(out.logits[j][-1:])
                row.drafter.begin(target, row.ids, out.aux[j] if want_aux else None)
                if not _finished(row, row.new, staged.lens[j], target, cfg):
                    queue.append((j, b))
        join = queue[:width - len(live)]
        del queue[:len(join)]
        bt.join(staged, [j for j, _ in join])
        for _, b in join:
            if theta:
                rows[b].drafter.set_budget(theta)
            live.append(b)
        sync(dev)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    prefill_s = 0.0
    batch_steps = []
    while live or waiting or queue:
        if (waiting or queue) and len(live) < width:
            prefill_s += admit()
            continue  # places still free (rows finished at their first token): admit again before a step
        if policy is not None:  # theta for this many live rows (re-chosen when rows finish)
            new_theta, curve = policy(len(live))
            if new_theta != theta:
                theta = new_theta
                for b in live:
                    if theta:
                        rows[b].drafter.set_budget(theta)
        # 1. draft: each live row proposes its tree (rooted at its last token)
        ta = time.perf_counter()
        proposers = ([rows[b].drafter for b in live] if policy is None or theta
                     else _copy_step([rows[b] for b in live], curve))
        trees = _draft([rows[b] for b in live], proposers, bt.lens, target.max_context)
        sync(dev)
        tb = time.perf_counter()
        # 2. verify: one target forward over every row's tree
        context = bt.end
        vo = bt.verify([tr for tr, _ in trees], want_aux=want_aux)
        sync(dev)
        tc = time.perf_counter()
        # 3. accept: each row's longest accepted path + bonus token, and its nodes' near-tie margins
        paths, margins = _accept([tr for tr, _ in trees], vo, cfg, [rows[b].gen for b in live])
        # 4. compact each row's cache to its accepted path; hand the accepted states to its drafter
        bt.commit([p for p, _ in paths])
        still = []
        for i, b in enumerate(live):
            emitted = _advance(rows[b], *trees[i], *paths[i], margins[i], vo.aux[i] if want_aux else None)
            if not _finished(rows[b], emitted, bt.lens[i], target, cfg):
                still.append(i)
        sync(dev)
        td = time.perf_counter()
        batch_steps.append({"rows": len(live), "max_tree": max(len(tr) for tr, _ in trees),
                            "theta": theta, "propose_ms": (tb - ta) * 1e3, "verify_ms": (tc - tb) * 1e3,
                            "accept_ms": (td - tc) * 1e3})
        # what the budget prices: the step beyond drafting (verify, accept, compact), as the one-sequence loop logs
        log_step(target, len(live), batch_steps[-1]["max_tree"], (td - tb) * 1e3, context)
        bt.keep(still)  # 5. finished rows leave the batch (their places go to waiting prompts at step 0)
        live[:] = [live[i] for i in still]
    decode_s = time.perf_counter() - t0 - prefill_s
    results = [_row_result(row, target, cfg, name, prefill_s, decode_s) for row in rows]
    return BatchResult(method=name or drafters[0].name, rows=results, prefill_s=prefill_s, decode_s=decode_s,
                       steps=batch_steps, config={"generation": asdict(cfg), "batch_size": width,
                                                  "requests": B, "runner": getattr(target, "runner", "hf")})


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
