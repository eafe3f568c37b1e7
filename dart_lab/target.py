"""The target model runner: prefill, verify a draft tree in one forward, compact the KV cache.

Any Hugging Face causal LM is driven through its *public* forward (no per-family modeling forks):
the tree is passed as `input_ids` with `position_ids = prefix_len + depth` and a 4D additive
attention mask (prefix fully visible, tree part = ancestor closure), on top of the model's own
`DynamicCache`. After acceptance the cache keeps exactly the accepted path (tree positions are
non-contiguous, so entries are moved, then the tail is dropped).

State convention (as EAGLE/DART): the cache holds every committed token except the last one, the
"root" of the next tree. The root is verified together with the drafts, so its logits give the
distribution of the first draft level and a bonus token is always available.

The three auxiliary hidden states that EAGLE3 and DART read are the *inputs* of decoder layers
2, L//2 and L-3, i.e. `hidden_states[2]`, `hidden_states[L//2]`, `hidden_states[L-3]` of HF's
`output_hidden_states` tuple (index 0 = embeddings). Paper section 3.1 / paper/METHOD.md "Draft head".
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .config import BudgetConfig
from .errors import DartLabError
from .tree import Tree


def sync(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock timings mean something on a GPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


ONE_SEQUENCE = 0  # `step_log`'s row count for the steps of `generate.generate` (one sequence, its own runner)
# Every decoded step is logged on its target (`log_step`): what the tree budget prices trees by
# (`measure.observed_curve`), whichever method decoded it


def step_kind(target, rows: int) -> tuple:
    """`step_log`'s key for steps of `rows` rows (ONE_SEQUENCE: the single-sequence loop) without the nodes:
    the arithmetic and compilation too (another dtype is another machine)."""
    return (target.precision, bool(getattr(target, "compile", False)), rows)


def log_step(target, rows: int, nodes: int, ms: float, context: int,
             memory: int = BudgetConfig.observed_memory) -> None:
    """Record one decoded step on the target's `step_log`: `rows` live rows of a batch (or ONE_SEQUENCE),
    `nodes` per row after padding, `context` cached positions it attended over, `ms` what it took."""
    log = target.step_log.setdefault(step_kind(target, rows) + (nodes,), [])
    log.append((ms, context))
    del log[:-memory]


@dataclass
class TargetOutput:
    """logits: (N, V) float32, one row per input token / tree node.
    aux: (N, 3H) concat of the three auxiliary hidden states, or None if not requested."""

    logits: torch.Tensor
    aux: torch.Tensor | None = None


@dataclass
class Target:
    """A causal LM plus its single-sequence KV cache (batch size 1).

    Call `prefill(prompt)` once, then alternate `verify(tree)` and `commit(path)`.
    """

    model: object
    tokenizer: object = None
    name: str = "custom"
    dtype_report: dict = field(default_factory=dict)
    # "dense": the model's own weights in its dtype; "int4": 4-bit weight-only matmuls over the same values
    # (fast runner only, int4.Int4Linear)
    weights: str = "dense"

    def __post_init__(self) -> None:
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        L = self.num_layers
        self.aux_layers = (2, L // 2, L - 3)  # inputs of these decoder layers (paper/METHOD.md)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        eos = set()
        for src in (getattr(self.model, "generation_config", None), cfg, self.tokenizer):
            val = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(val, int):
                eos.add(val)
            elif isinstance(val, (list, tuple)):
                eos.update(int(v) for v in val)
        self.eos_ids = frozenset(eos)
        # transformers renamed `past_key_values` to `cache` (5.x deprecates the old name)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache = None
        self.seq_len = 0  # number of tokens in the KV cache
        self._pending = 0  # tree nodes appended by the last verify, awaiting commit
        self._prefilled = False
        self.runner = "hf"  # the public-forward runner (runner.FastTarget is the lean one)
        # verify ms of the batched steps decoded on this target, by (arithmetic, compiled, rows, nodes per
        # row): what the machine did while decoding, read by the batch budget (measure.observed_curve)
        self.step_log: dict = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def precision(self) -> str:
        """The arithmetic of the forward, as results name it: the dtype, or "int4" (see `weights`)."""
        return "int4" if self.weights == "int4" else str(self.dtype)

    # -- prompts
    def cost_key(self) -> dict:
        """What this runner adds to the cache key of its measured verify cost (`measure.fingerprint`): the public
        forward runs torch's kernels only, so nothing (the lean runner adds its kernels' build and 4-bit paths)."""
        return {}

    def encode_prompt(self, text: str, chat: bool = True) -> torch.Tensor:
        """(T,) prompt ids; applies the chat template when the tokenizer has one."""
        if not isinstance(text, str) or not text.strip():
            raise DartLabError("prompt is empty")
        if self.tokenizer is None:
            raise DartLabError("this target has no tokenizer; pass token ids instead of text")
        if chat and getattr(self.tokenizer, "chat_template", None):
            enc = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     return_tensors="pt", return_dict=True)
            ids = enc["input_ids"][0]
        else:
            ids = self.tokenizer(text, return_tensors="pt").input_ids[0]
        return ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- forward passes
    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.seq_len = 0
        self._pending = 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, want_aux: bool,
                 rows: slice | None = None) -> TargetOutput:
        """ids, positions (N,); mask from `tree_mask` or None (causal). rows: the logits wanted."""
        out = self.model(input_ids=ids[None].to(self.device), position_ids=positions[None].to(self.device),
                         attention_mask=mask, use_cache=True, output_hidden_states=want_aux,
                         **{self._cache_kw: self.cache})
        aux = None
        if want_aux:
            hs = out.hidden_states
            aux = torch.cat([hs[i][0] for i in self.aux_layers], dim=-1)
        logits = out.logits[0] if rows is None else out.logits[0, rows]
        return TargetOutput(logits.float(), aux)

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, want_aux: bool = False, all_logits: bool = True) -> TargetOutput:
        """Reset the cache and run the prompt (T,) causally. Returns logits (T, V) (the last row picks
        the first new token; only that row, (1, V), unless all_logits) and aux (T, 3H)."""
        prompt_ids = self.check_prompt(prompt_ids)
        self.reset()
        T = prompt_ids.numel()
        out = self._forward(prompt_ids, torch.arange(T), None, want_aux, rows=None if all_logits else slice(-1, None))
        self.seq_len = T
        self._prefilled = True
        return out

    def check_prompt(self, prompt_ids) -> torch.Tensor:
        """prompt_ids as a (T,) long tensor, or a one-line DartLabError naming what is wrong with it."""
        prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        if prompt_ids.numel() == 0:
            raise DartLabError("prompt is empty")
        if prompt_ids.numel() >= self.max_context:
            raise DartLabError(f"prompt has {prompt_ids.numel()} tokens, the target's context is {self.max_context}")
        if int(prompt_ids.max()) >= self.vocab_size or int(prompt_ids.min()) < 0:
            raise DartLabError(f"prompt has token ids outside the target vocabulary (size {self.vocab_size})")
        return prompt_ids

    def tree_mask(self, tree: Tree) -> torch.Tensor:
        """(1, 1, N, P+N) additive mask: 0 where attention is allowed, dtype-min elsewhere."""
        N, P = len(tree), self.seq_len
        allowed = torch.ones(N, P + N, dtype=torch.bool)
        allowed[:, P:] = tree.ancestor_mask()
        m = torch.zeros(N, P + N, dtype=self.dtype)
        m.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return m[None, None].to(self.device)

    @torch.no_grad()
    def verify(self, tree: Tree, want_aux: bool = False) -> TargetOutput:
        """One forward over all N tree nodes (node 0 = root, the last committed token).

        Node i sits at position seq_len + depth[i] and attends to the whole cached prefix and to its
        own ancestors. logits[i] is the target's next-token distribution after the path root..i,
        equal (up to float rounding) to running that path sequentially. Must be followed by `commit`.
        """
        if self._pending:
            raise RuntimeError("verify called twice without commit")
        if not self._prefilled:
            raise RuntimeError("call prefill before verify")
        if self.seq_len + int(tree.depths.max()) + 1 > self.max_context:
            raise DartLabError(f"sequence would exceed the target's context ({self.max_context} tokens)")
        # A single-node tree (AR step) needs no mask: plain causal attention is the same thing.
        mask = None if len(tree) == 1 else self.tree_mask(tree)
        out = self._forward(tree.tokens, self.seq_len + tree.depths, mask, want_aux)
        self._pending = len(tree)
        return out

    def truncate(self, n: int) -> None:
        """Drop every cache entry after the first n tokens (a drafter's speculative steps)."""
        if n > self.seq_len or self._pending:
            raise RuntimeError("truncate keeps committed tokens only")
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
        self.seq_len = n

    def commit(self, path: list[int] | torch.Tensor) -> None:
        """Keep the KV entries of the accepted tree nodes `path` (root first, ancestor order), drop
        the rest. Entries move from positions P+path to P..P+k-1, then the cache is cut at P+k."""
        P, k = self.seq_len, len(path)
        idx = torch.as_tensor(path, dtype=torch.long)
        if k == 0 or int(idx[0]) != 0:
            raise RuntimeError("an accepted path starts at the root (node 0)")
        contiguous = bool(torch.equal(idx, torch.arange(k)))
        src = (P + idx).to(self.device)
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False):
                raise DartLabError("sliding-window KV caches are not supported by tree verification")
            keys, values = layer.keys, layer.values
            if not contiguous:
                # gather first (advanced indexing copies), then write into the contiguous slots
                keys[..., P:P + k, :] = keys[..., src, :]
                values[..., P:P + k, :] = values[..., src, :]
            layer.keys, layer.values = keys[..., :P + k, :], values[..., :P + k, :]
        self.seq_len = P + k
        self._pending = 0
