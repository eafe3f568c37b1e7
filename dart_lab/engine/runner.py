"""A lean target runner for the Llama family (Llama, Mistral, Qwen2, Qwen3): the same `Target`
interface, a plain-PyTorch forward over the HF model's own weights and modules.

Why: on a CPU most of the extra cost of verifying a big tree
through the HF public forward is overhead -- the 4D additive mask HF rebuilds, a DynamicCache that
grows by concatenation every step, the full hidden-states tuple -- not the matmuls. Here:
  - a preallocated KV cache (L, 1, kv_heads, capacity, head_dim) per K and V, written in place;
    compaction of the accepted path is ONE gather/scatter over all layers (`commit`);
  - tree attention with an additive (N, P+N) mask built once per step, GQA without repeating K/V; for a
    half type on a CPU the attention is fp32 (the CPU kernels are faster there), over a bf16 K/V cache where
    our kernel reads one (`cache_dtype`: half the bytes a step streams), else fp32; steps of a
    few nodes a row on our attention kernel where it measured faster than SDPA (`attention.attend`);
  - the three aux states taken where they are produced (inputs of layers 2, L//2, L-3);
  - logits only where needed (prefill: the last row unless asked for all);
  - on a CPU, the projections as oneDNN-packed fused weights (q|k|v and gate|up as one matmul each):
    the packed layout lets oneDNN skip re-blocking the weight at every call, which is most of a
    small-M matmul's time (docs/speed.md);
  - `weights="int4"` (`--dtype int4`): 4-bit weight-only matmuls (torch's CPU int4 kernel) over the same
    values where the weights are 4-bit grids, as the embedded target's GGUF Q4_1 layers are: a one-token
    step reads ~4.5 bits per weight instead of 32 (`Int4Linear`; docs/speed.md for what it measures).
    The 4-bit kernel's cost grows with a step's rows faster than a 16-bit matmul's, so each linear takes,
    per row count, the path measured fastest on this machine (`int4_by_rows`: 4 bits, the dense weights,
    bf16 copies where oneDNN packs bf16): AR's one-token steps in 4 bits, a wide tree or batch dense.
  - optionally (`compile=True`, `--compile`), one-token steps and tree verifies through `torch.compile`
    with static shapes (`StepGraph`: nodes padded to a few buckets, attention over the cache in fixed
    multiples of slots under the additive mask, inductor's freezing packing the weights): fused small
    ops and a cheaper step, but tens of seconds of compiling per shape on a small CPU, so off by default
    (experiments/engine/compile_bench.py).
Norms and rotary embedding are the HF modules' own; the packed copies are rebuilt when the model's
dtype or device changes, so a `model.to(dtype)` applies here too. `target.Target` (the public forward) stays the reference:
tests/test_fast_runner.py checks logits, aux states and compaction against it on random trees.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import kernels
from . import q4
from .attention import available as attention_available, prepare as prepare_attention
from ..target import Target, TargetOutput
from ..tree import Tree
from .int4 import PackedLinear, side_by_side, can_int4, can_pack, int4_by_rows, int4_projections
from .step import StepGraph, decoder_step

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model) -> str | None:
    """None if the fast runner can drive `model`, else why not (the HF runner is used then)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {', '.join(FAMILIES)}"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")):
        return "unexpected module layout"
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", True) and window is not None
    if uses_window and window < getattr(cfg, "max_position_embeddings", 1 << 30):
        return "sliding-window attention"
    att = inner.layers[0].self_attn
    if not all(hasattr(att, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "unexpected attention layout"
    return None



@dataclass
class FastTarget(Target):
    """`Target` with the lean forward (module docstring). Same protocol: prefill, verify, commit."""

    capacity_step: int = 512  # the cache grows in steps of this many positions (rarely: one reallocation)
    fp32_attention: bool = True  # CPU, half types: attention in fp32 (see _forward)
    # CPU with our attention kernel, bf16 or 4-bit weights: the K/V cache stored in bf16, half the bytes a step
    # streams (a batch's step reads more K/V than weights); exact for bf16 weights (their K/V are bf16 values),
    # for 4-bit ones part of that arithmetic (its matmuls already take bf16 inputs). fp32 weights keep fp32.
    bf16_cache: bool = True
    pack_weights: bool = True  # CPU, fp32/bf16: oneDNN-packed fused projections (module docstring)
    # torch.compile of one-token steps and tree verifies (StepGraph; prefill stays eager): off by default,
    # compiling costs tens of seconds per shape on a small CPU and pays only over long runs
    # (experiments/engine/compile_bench.py)
    compile: bool = False
    # torch.compile's mode for those steps: None (inductor's default) or "reduce-overhead" (CUDA graphs on a GPU:
    # a step there is bound by kernel launches, not by the device)
    compile_mode: str | None = None
    node_buckets: tuple = (1, 2, 4, 8, 16, 32, 64)  # a step of N nodes runs padded to the next of these
    # compiled attention reads exactly the cached keys, their number a symbol in the graph (None), or a
    # multiple of this many slots (one graph per multiple, the padding read too: dearer, and compiling
    # more; measured in docs/speed.md's table of what was tried)
    key_bucket: int | None = None
    compile_capacity: int = 4096  # cache slots allocated at once when compiling (longer: eager steps)
    # part of the cost curve's cache key (measure.fingerprint): raised when a change moves verify cost, so
    # a curve measured with older code is not reused (2: the additive tree mask; 3: decoder_step, cache
    # writes by index_copy_; 4: fused norms and one-pass rotation for fp32 activations; 5: steps of a few
    # nodes a row on our attention kernel where it measures faster, attention.py; 6: eager fp32 norms on our
    # one-pass op, csrc/norm.cpp; 7: the attention kernel prefetches K and V; 8: it cuts a tree's query rows
    # into blocks over the threads; 9: it skips the keys every position of a row masks; 10: bf16 K/V caches; 11:
    # rotation and cache write in one op, csrc/rope.cpp; 12: the MLP's silu * up in one dispatch; 13: a step's
    # layers in one op where every linear takes our 4-bit kernel, csrc/layers.cpp; 14: a step's argmaxes and margins
    # in one pass over the logits, a batch's compaction as plain copies, a prompt's rotation in one op; 15: a batch
    # step's pad nodes skipped by the linears and the attention kernel; 16: the eager layers skip them too, and the
    # weights' key is taken once a request; 17: the attention kernel's scores 4 keys at a time, each row's mask and
    # max on vectors; 18: q scaled as the attention kernel loads it, the MLP's fp32 silu * up in one pass; 19: a
    # layer's norms and residual adds inside the 4-bit kernel that reads or writes them; 20: the eager-step kernels
    # built for AVX2 too)
    runner_revision = 20
    # the same for the 4-bit path alone, so a change there leaves dense curves valid (2: the LM head in
    # 4-bit halves for 2+ rows and in fp16 for one row; 3: each linear's path measured per row count;
    # 4: a prompt on its rows' path; 5: compiled steps on the measured paths too; 6: our 4-bit kernel, q4.py,
    # one more measured path; 7: the LM head's halves on it too; 8: 128 rows in the sweep, where prompts
    # of 100-200 tokens cross from 4 bits to bf16; 9: our kernel prefetches, several rows cheaper; 10: several
    # rows on AMX tiles where the CPU has them; 11: two groups at a time through two sets of tiles, AMX from 2 rows; 12:
    # 1024 rows in the layers' sweep, a batch's prompts packed in one forward; 13: our kernel on CPUs with AVX2 only;
    # 14: a median out of proportion with its path's previous one timed again, each output dropped in a sweep;
    # 15: the AMX tiles' groups software-pipelined, 2-16 rows cheaper; 16: the AVX-512 path prefetches 2 KB ahead;
    # 17: the AVX2 path multiplies x's groups as 16-bit integers; 18: the Q8_0 LM head one product a weight, q8mm)
    int4_revision = 18
    # int4 steps: "measured" = each linear takes the path measured fastest for the step's rows (4 bits,
    # the dense weights, bf16 copies: `int4_by_rows`), compiled or not; "4bit" = 4 bits at every width (one
    # arithmetic for AR and trees)
    int4_paths: str = "measured"

    def __post_init__(self) -> None:
        super().__post_init__()
        why = unsupported_reason(self.model)
        if why:
            raise ValueError(f"fast runner: {why}")
        inner, cfg = self.model.model, self.model.config
        att = inner.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(att, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scaling = getattr(att, "scaling", self.head_dim ** -0.5)
        self.qk_norm = hasattr(att, "q_norm")
        self.runner = "fast"
        self._k = self._v = None
        self._packed, self._packed_key, self._params, self._key = None, None, None, None
        self._int4_packed, self._int4_key, self._int4_rows = None, None, None
        self._kv_views, self._step_graph = None, None
        self.compile_seconds = 0.0  # time spent in first calls of new shapes (compiling), this target's life

    def cost_key(self) -> dict:
        """`Target.cost_key`: which build of our kernels runs (AVX-512 or AVX2: csrc/vec.h), whether the norms take
        our one-pass op, and for 4-bit weights the paths' revision and choice and whether our 4-bit kernel runs."""
        return {"norm_kernel": kernels.rms_norm_here(), "kernel_isa": kernels.isa(),
                **({"int4_revision": self.int4_revision, "int4_paths": self.int4_paths, "q4_kernel": q4.available()}
                   if self.precision == "int4" else {})}

    @property
    def packs_weights(self) -> bool:
        """Whether the forward uses oneDNN-packed projections (part of the cost curve's cache key)."""
        return self.pack_weights and can_pack(self.device, self.dtype)

    def _packs(self):
        """Per layer (qkv, o, gate_up, down) PackedLinears and the lm_head's, or None (plain F.linear).
        Built on first use and again whenever the model's dtype, device or weights change."""
        if not self.packs_weights:
            return None
        inner = self.model.model
        key = self._weights_key()
        if key != self._packed_key:
            with torch.no_grad():
                layers = [(PackedLinear(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj),
                           PackedLinear(l.self_attn.o_proj), PackedLinear(l.mlp.gate_proj, l.mlp.up_proj),
                           PackedLinear(l.mlp.down_proj)) for l in inner.layers]
                self._packed, self._packed_key = (layers, PackedLinear(self.model.lm_head)), key
        return self._packed

    @property
    def compiled_shapes(self) -> set:
        """(node bucket, key bucket or None: any) shapes compiled so far (`compile=True`), each once."""
        return set(self._step_graph.shapes) if self._step_graph is not None else set()

    @property
    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V caches (L, 1, kv_heads, capacity, head_dim), None before the first forward."""
        return None if self._k is None else (self._k, self._v)

    def _weights_key(self) -> tuple:
        """What the weights are: a weight replaced (new storage) or edited in place (version bump) changes it.
        Taken at a request's prompt (`_fresh_weights`) and kept for its steps -- an edit reaches the next
        prompt's forward -- since reading ~270 tensors' pointers and versions every step cost ~0.25 ms."""
        if self._key is None:
            if self._params is None:
                self._params = list(self.model.parameters())
            self._key = (self.dtype, self.device, [p.data_ptr() for p in self._params],
                         sum(p._version for p in self._params))
        return self._key

    def _fresh_weights(self) -> None:
        """A new request: list the parameters again and take the weights' key anew at the next forward."""
        self._params, self._key = None, None

    @property
    def dtype(self) -> torch.dtype:
        # read every step several times: the listed parameters' first, not a walk of the module tree
        params = getattr(self, "_params", None)  # (None until listed, absent during __post_init__)
        return params[0].dtype if params else super().dtype

    @property
    def device(self) -> torch.device:
        params = getattr(self, "_params", None)
        return params[0].device if params else super().device

    def _int4(self, by_rows: bool | None = None) -> tuple[list, object]:
        """`int4_projections` of the current weights (by_rows: each linear's path measured per row count,
        `int4_by_rows`; default: `int4_paths`), built on first use and when the weights change."""
        if not can_int4(self.device):
            raise RuntimeError(f"int4 weights need torch's CPU int4 kernel (device {self.device.type})")
        by_rows = self.int4_paths == "measured" if by_rows is None else by_rows
        key = self._weights_key()
        if key != self._int4_key:
            with torch.no_grad():
                layers, head, report = int4_projections(self.model)
            self._int4_packed, self._int4_key, self._int4_rows = (layers, head), key, None
            self.dtype_report = {**self.dtype_report, "int4": report}
        if not by_rows:
            return self._int4_packed
        if self._int4_rows is None:
            self._int4_rows = self._int4_by_rows()
        return self._int4_rows

    def _int4_by_rows(self) -> tuple[list, object]:
        """`int4_by_rows`, its tables cached per machine like a cost curve (`measure.fingerprint`; served only
        when measured on a quiet machine, and a contended measurement is not written)."""
        from ..atomic import write_json
        from ..measure import cost_file, fingerprint, read_quiet
        from ..machine import LoadMeter

        path, tables = cost_file("int4_paths_", fingerprint(self)), None
        d = read_quiet(path)
        if d is not None:
            try:
                tables = {k: tuple((int(r), n) for r, n in t) for k, t in d["tables"].items()}
            except (KeyError, TypeError, ValueError, AttributeError):
                tables = None
        with torch.no_grad(), LoadMeter() as meter:
            try:
                layers, head, report = int4_by_rows(self.model, self._int4_packed, self._dense(),
                                                    tables)
            except KeyError:  # a cached table names a path this build lacks: measure again
                tables = None
                layers, head, report = int4_by_rows(self.model, self._int4_packed, self._dense())
        if tables is None and not meter.load["contended"]:
            write_json(path, {"tables": report["tables"], "ms_by_rows": {k: v["ms_by_rows"] for k, v in report.items()
                                                                          if k != "tables"},
                              "machine_load": meter.load, "measured_at": time.time()})
        report["cached"] = tables is not None
        self.dtype_report = {**self.dtype_report, "int4": {**self.dtype_report["int4"], "by_rows": report}}
        return layers, head

    # -- cache
    @property
    def attention_dtype(self) -> torch.dtype:
        """The dtype attention computes in (queries, additive masks)."""
        dt = self.dtype
        half = dt in (torch.bfloat16, torch.float16)
        return torch.float32 if (self.fp32_attention and half and self.device.type == "cpu") else dt

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the K/V cache is stored in (`bf16_cache`). Asked at every forward: the model's dtype read once."""
        dt, attention = self.dtype, self.attention_dtype
        narrow = dt == torch.bfloat16 or self.weights == "int4"
        if (self.bf16_cache and narrow and attention == torch.float32 and self.device.type == "cpu"
                and attention_available()):
            return torch.bfloat16
        return attention

    @property
    def attention_nodes(self) -> int:
        """The most nodes a row a step takes our attention kernel for (attention.py), measured once per process,
        head geometry and cache dtype -- asked before a forward, not inside a compiled graph's tracing."""
        return prepare_attention(self.n_heads, self.n_kv, self.head_dim, self.device, self.cache_dtype)

    def _ensure(self, n: int) -> None:
        """Capacity for n positions, on the model's current device, in `cache_dtype` (kept contents)."""
        dev, dt = self.device, self.cache_dtype
        if self._k is not None and self._k.shape[3] >= n and self._k.dtype == dt and self._k.device == dev:
            return
        self.attention_nodes  # measured before the first step with this cache
        cap = min(max(n, 1) + self.capacity_step, max(self.max_context, n))
        shape = (self.num_layers, 1, self.n_kv, cap, self.head_dim)
        # zeros, not empty: a compiled step attends over whole blocks of slots with the unused ones masked,
        # and a masked slot's weight 0 times a NaN left in uninitialised memory is still NaN
        k, v = torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev)
        if self._k is not None and self.seq_len:
            k[:, :, :, :self.seq_len] = self._k[:, :, :, :self.seq_len].to(dt)
            v[:, :, :, :self.seq_len] = self._v[:, :, :, :self.seq_len].to(dt)
        self._k, self._v = k, v

    def reset(self) -> None:
        self.seq_len = 0
        self._pending = 0

    def tree_mask(self, tree: Tree) -> torch.Tensor:
        """(N, P+N) bool: True where attention is allowed (prefix, then the ancestor closure)."""
        N, P = len(tree), self.seq_len
        allowed = torch.ones(N, P + N, dtype=torch.bool)
        allowed[:, P:] = tree.ancestor_mask()
        return allowed.to(self.device)

    # -- forward
    def projections(self, prefill: bool = False) -> tuple[list, object]:
        """Per layer (qkv, o, gate_up, down) callables and the LM head for an eager forward. When `weights`
        is "int4": with `int4_paths` "measured", every forward (a prompt too) takes each linear's path
        measured fastest for its row count (`int4_by_rows`: a prompt's hundreds of rows go where a wide
        tree goes: bf16 copies on a CPU with bf16 units, faster than fp32 there); with "4bit", decoding
        steps in 4 bits at every width (one arithmetic) and a prompt through the dense weights, since the
        4-bit CPU kernel's cost grows about linearly in rows. Else `_dense`."""
        if prefill:
            self._fresh_weights()
        if self.weights == "int4" and (not prefill or self.int4_paths == "measured"):
            return self._int4()
        return self._dense()

    def _dense(self) -> tuple[list, object]:
        """The model's own weights in its dtype: oneDNN-packed where that applies, else the HF modules'
        weights through F.linear (q|k|v, gate|up side by side)."""
        packs = self._packs()
        if packs:
            return packs
        return [(side_by_side(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj), l.self_attn.o_proj,
                 side_by_side(l.mlp.gate_proj, l.mlp.up_proj), l.mlp.down_proj)
                for l in self.model.model.layers], self.model.lm_head

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, want_aux: bool,
                 rows: slice | None = None) -> TargetOutput:
        """ids, positions (N,); mask (N, P+N) bool or None (causal prefill / a single token)."""
        P, N = self.seq_len, ids.numel()
        if P == 0:
            self._fresh_weights()
        if self.compile and (P > 0 or N == 1):
            out = self._compiled_step(ids, positions, mask, want_aux)
            if out is not None:
                return out
        self._ensure(P + N)
        dev = self.device
        # a half type on a CPU: a step's attention runs in fp32 -- SDPA's CPU kernel is faster there than in bf16
        # for a few query rows (a prompt on bf16 copies: `decoder_step`'s choice); the
        # K/V cache is bf16 where our kernel reads it (`cache_dtype`), else fp32 (docs/speed.md)
        attn_mask = None
        if mask is not None:  # additive, built once per forward: a bool mask is converted by SDPA in every
            # layer (2 ops each, a tenth of a tree attention's time)
            attn_mask = torch.zeros(mask.shape, dtype=self.attention_dtype, device=dev).masked_fill_(
                ~mask.to(dev), float("-inf"))[None, None]
        slots = torch.arange(P, P + N, device=dev)
        logits, aux = decoder_step(self.model, *self.projections(prefill=P == 0), self._geometry(), ids.to(dev),
                                   positions.to(dev), slots, self._layer_caches(), P + N, attn_mask,
                                   causal=mask is None and N > 1 and P == 0, rows=rows)
        return TargetOutput(logits, aux if want_aux else None)

    def _geometry(self) -> tuple:
        return (self.n_heads, self.n_kv, self.head_dim, self.scaling, self.qk_norm, self.aux_layers,
                self.attention_dtype)

    def _layer_caches(self) -> tuple[list, list]:
        """Per-layer views (1, kv_heads, capacity, head_dim) of the K and V caches."""
        if self._kv_views is None or self._kv_views[0][0]._base is not self._k:
            self._kv_views = (list(self._k.unbind(0)), list(self._v.unbind(0)))
        return self._kv_views

    # -- compiled steps
    def _compiled_step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                       want_aux: bool) -> TargetOutput | None:
        """A one-token step or tree verify through `torch.compile` with static shapes: N nodes padded to
        the next of `node_buckets` (dummy nodes attend only to themselves and write cache slots past the
        tree, which nothing reads), attention over the P + nb cache slots in use (or the first
        `key_bucket`-multiple of slots, an additive mask hiding the rest). None when the step does not fit
        (more nodes than the largest bucket, or past `compile_capacity`): the eager forward runs then."""
        P, N = self.seq_len, ids.numel()
        nb = next((b for b in self.node_buckets if b >= N), None)
        nk = P + nb if nb else None  # the slots in use, or with static key buckets the next multiple
        if nk and self.key_bucket:
            nk = -(-nk // self.key_bucket) * self.key_bucket
        cap = min(self.compile_capacity, self.max_context)
        if nb is None or nk > cap:
            return None
        self._ensure(cap)  # one allocation: a new cache shape would recompile every graph
        dev = self.device
        allowed = torch.zeros(nb, nk, dtype=torch.bool)
        allowed[:N, :P] = True
        allowed[:N, P:P + N] = mask[:, P:] if mask is not None else True  # mask None: N == 1
        allowed[N:, P + N:P + nb] = torch.eye(nb - N, dtype=torch.bool)
        attn_mask = torch.zeros(nb, nk, dtype=self.attention_dtype).masked_fill_(~allowed, float("-inf"))
        slots = torch.arange(P, P + nb)
        pad_ids = torch.cat([ids.cpu(), ids.new_zeros(nb - N).cpu()])
        pad_pos = torch.cat([positions.cpu(), slots[N:]])
        graph = self._graph()
        static_keys = nk if self.key_bucket else None
        new_shape, t0 = (nb, static_keys) not in graph.shapes, time.perf_counter()
        logits, aux = graph.run(pad_ids.to(dev), pad_pos.to(dev), slots.to(dev), attn_mask[None, None].to(dev),
                                *self._layer_caches(), static_keys)
        if new_shape:  # the first call of a shape compiles it
            self.compile_seconds += time.perf_counter() - t0
        return TargetOutput(logits[:N], aux[:N] if want_aux else None)

    @torch.no_grad()
    def precompile(self, context: int) -> int:
        """Compile now every (node bucket, key bucket) shape a decode within `context` tokens can meet
        (`compile=True`; else nothing), so that timed decodes do not compile: one verify of a chain of each
        bucket's size (after a prompt that puts it in each key bucket, where keys are bucketed). Returns the
        shapes compiled now."""
        if not self.compile:
            return 0
        before = set(self.compiled_shapes)
        g = torch.Generator().manual_seed(0)
        V = min(self.vocab_size, 1000)
        kb, cap = self.key_bucket, min(self.compile_capacity, self.max_context)
        key_counts = range(kb, min(-(-context // kb) * kb, cap) + 1, kb) if kb else [min(context, cap)]
        for nk in key_counts:
            for nb in self.node_buckets:
                P = nk - nb  # P + nb cached slots: the last of key bucket nk (exact keys: any count compiles it)
                if P < 1 or (nb, nk if kb else None) in before:
                    continue
                self.prefill(torch.randint(3, V, (P,), generator=g))  # P committed; the chain's root is new
                self.verify(Tree(torch.randint(3, V, (nb,), generator=g), torch.arange(-1, nb - 1)))
                self.commit([0])
        return len(self.compiled_shapes - before)

    def _graph(self) -> "StepGraph":
        """The compiled step for the model's current weights (rebuilt, and recompiled, when they change)."""
        key = (self._weights_key(), self.weights)
        if self._step_graph is None or self._step_graph.key != key:
            self._step_graph = StepGraph(self, key)
        return self._step_graph

    def truncate(self, n: int) -> None:
        if n > self.seq_len or self._pending:
            raise RuntimeError("truncate keeps committed tokens only")
        self.seq_len = n

    def commit(self, path) -> None:
        P, k = self.seq_len, len(path)
        idx = torch.as_tensor(path, dtype=torch.long)
        if k == 0 or int(idx[0]) != 0:
            raise RuntimeError("an accepted path starts at the root (node 0)")
        if not torch.equal(idx, torch.arange(k)):  # move the accepted entries, all layers at once
            src = (P + idx).to(self.device)
            self._k[:, :, :, P:P + k] = self._k[:, :, :, src]
            self._v[:, :, :, P:P + k] = self._v[:, :, :, src]
        self.seq_len = P + k
        self._pending = 0
