"""The batch's target: B rows' caches in one layout, one forward per step over every row's tree (`BatchTarget`),
on the compact runner's decoder step or through the public forward. The cache layout and why it is shared by
both runners: the module docstring of `batch.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from ..errors import DartLabError
from ..target import Target
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


def _packs(lengths: list[int], most: int) -> list[list[int]]:
    """Consecutive prompt lengths grouped so a group's tokens stay within `most` (a longer prompt alone)."""
    groups: list[list[int]] = []
    for n in lengths:
        if groups and sum(groups[-1]) + n <= most:
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups
