"""The Llama-family decoder step (`decoder_step`: the one home of the layer math) and its compiled form
(`StepGraph`, torch.compile over static shapes).
"""
from __future__ import annotations


import contextlib
import inspect
import warnings
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import kernels
from .attention import attend, ours as attention_ours
from .attention import prompt_dtype as prompt_attention
from .int4 import ByRows, bf16_mlp, bf16_path, dtype_name
from .q4 import Q4Linear


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The family's RMSNorm module applied to x (every family in FAMILIES computes w * x / rms(x) in fp32,
    then casts x back before the weight): for fp32 activations and weight the same arithmetic as torch's
    one-op `F.rms_norm` (bit-equal in our checks at the embedded model's width), one dispatch instead of
    the module's eight small ops -- a visible share of an eager one-token step (docs/speed.md); eagerly, on
    a CPU where it builds, our one-pass op (`kernels.rms_norm_here`: ~2 us a call against F.rms_norm's ~10)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        if (x.device.type == "cpu" and x.is_contiguous() and not torch.compiler.is_compiling()
                and kernels.rms_norm_here()):
            return torch.ops.dart_lab.rms_norm.default(x, norm.weight, norm.variance_epsilon)
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm(x)



def decoder_step(model, projs, head, geometry: tuple, ids: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, caches: tuple[list, list], n_keys: int, attn_mask: torch.Tensor | None,
                 causal: bool = False, rows: slice | torch.Tensor | None = None,
                 segments: list[tuple[int, int]] | None = None,
                 live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Llama-family decoder over N new nodes of B rows: the one home of the layer math, run eagerly
    by `FastTarget` and `batch_target.BatchTarget`, and compiled by `StepGraph`.

    ids, positions (N,) for one row, or (B, N) for a batch; slots (N,): the cache slots the nodes' K/V
    are written to (the same for every row); caches: per-layer K and V, (B, kv_heads, capacity, head_dim)
    each; attention reads slots [0, n_keys) under `attn_mask` (B, 1, N, n_keys) additive, or causally;
    projs: per layer (qkv, o, gate_up, down) callables; head: the LM head. Returns logits fp32 and the aux
    states (the inputs of the aux layers, paper Sec. 3.1, in `geometry`'s order): one row -> (N or the
    `rows` slice, V) and (N, 3H); a batch -> logits of the flat node indices `rows` into B * N (all when
    None), (M, V), and aux (B, N, 3H).
    segments (causal only): several prompts packed end to end in one row, prompt r at [start, end) of N,
    its K/V written to slots [0, end - start) of cache row r and each attending causally to its own tokens
    only; the linears run once over all of them (more rows a matmul: a batch's prefill).
    live (a batch): the flat indices into B * N of its real nodes, where the others are pads that see only
    themselves (`batch_target.BatchTarget.verify`): the linears skip the pads (their outputs 0; in the layers-in-one-op
    path by its rows, eagerly by gathering the real nodes around each linear, which then takes the path of
    that many rows), so a row padded to the step's widest tree costs about what its own tree does.
    """
    nh, nkv, hd, scaling, qk_norm, aux_layers, attention_dtype = geometry
    inner = model.model
    batched = ids.dim() == 2
    if not batched:
        ids, positions = ids[None], positions[None]
    B, N = ids.shape
    x = inner.embed_tokens(ids)  # (B, N, H)
    rows_cos, rows_sin = inner.rotary_emb(x, positions)  # (B, N, hd)
    plan = _plan(model, projs, geometry, x, rows_cos, rows_sin, caches, causal, batched, live, B, N)
    if plan.stack is not None:  # every linear on our 4-bit kernel, attention on ours: the layers in one op, same numbers
        x, tapped = torch.ops.dart_lab.q4_layers.default(x, *plan.stack, rows_cos, rows_sin, caches[0], caches[1], slots,
                                                         attn_mask, n_keys, scaling, nh, nkv, list(aux_layers),
                                                         live if plan.skip else None)
        taps = dict(zip(aux_layers, tapped))
    else:
        taps = {}
    real = _real_nodes(B, N, live) if plan.skip and plan.stack is None else (lambda f: f)
    for i, layer in enumerate(inner.layers if plan.stack is None else ()):
        if i in aux_layers:
            taps[i] = x
        qkv, o_proj, gate_up, down = projs[i]
        heads = real(qkv)(_rms_norm(layer.input_layernorm, x)).view(B, N, nh + 2 * nkv, hd)
        o = _attention(layer.self_attn, heads, plan, geometry, rows_cos, rows_sin, caches[0][i], caches[1][i], slots,
                       n_keys, attn_mask, causal, segments)
        o_bf16 = bf16_path(o_proj, B * N) if o.dtype == torch.bfloat16 and not plan.skip else None
        if o_bf16 is not None:  # a bf16 prompt's heads straight into the o projection's bf16 copy (no round trip)
            x = x + o_bf16.raw(o.reshape(B, N, nh * hd)).to(x.dtype)
        else:
            x = x + real(o_proj)(o.to(x.dtype).reshape(B, N, nh * hd))
        x = x + real(_mlp(layer, gate_up, down, plan))(_rms_norm(layer.post_attention_layernorm, x))
    aux = torch.cat([taps[i] for i in aux_layers], dim=-1)
    if not batched:
        return head(_rms_norm(inner.norm, x[0] if rows is None else x[0, rows])).float(), aux[0]
    h = x.reshape(B * N, -1) if rows is None else x.reshape(B * N, -1)[rows]  # only the rows whose logits are read
    return head(_rms_norm(inner.norm, h)).float(), aux


class _Plan(NamedTuple):
    fused: bool  # rotation and cache write as one op
    prompt_rope: bool  # a prompt's rotation as one op
    fused_mlp: bool  # silu * up as one dispatch
    skip: bool  # the linears skip a batch's pad nodes
    mlp_bf16: tuple | None  # the MLP's bf16 copies' paths, or None
    nodes: int  # real nodes a row
    prompt_dtype: torch.dtype  # a prompt's attention dtype
    stack: tuple | None  # the layers-in-one-op arguments, or None


def _plan(model, projs, geometry: tuple, x, rows_cos, rows_sin, caches, causal: bool, batched: bool, live, B: int,
          N: int) -> _Plan:
    """Which paths `decoder_step` takes for this step, decided once for all layers."""
    nh, nkv, hd, scaling, qk_norm, aux_layers, attention_dtype = geometry
    # an eager fp32 step on a CPU with our kernel: rotation and cache write as one op (csrc/rope.cpp), the
    # same arithmetic as the torch ops; a prompt attends over its own K/V, a compiled graph fuses the torch ops itself
    rope_op = (not qk_norm and x.dtype == torch.float32 and x.device.type == "cpu"
               and rows_cos.dtype == torch.float32 and rows_cos.is_contiguous() and rows_sin.is_contiguous()
               and not torch.compiler.is_compiling() and kernels.rope_cache_here())
    fused = rope_op and not causal
    fused_mlp = (x.device.type == "cpu" and getattr(model.config, "hidden_act", None) in ("silu", "swish")
                 and not torch.compiler.is_compiling() and kernels.rms_norm_here())
    skip = batched and live is not None and live.numel() < B * N and x.device.type == "cpu"
    mlp_bf16 = bf16_mlp(projs, live.numel() if skip else B * N) if fused_mlp else None
    nodes = -(-live.numel() // B) if skip else N  # real nodes a row (rounded up): what attention's choice weighs
    # a prompt whose MLP runs on bf16 copies of the weights attends in bf16 too where torch's SDPA measured
    # faster in it on this CPU (`attention.prompt_dtype`; bf16 matrix units: about half the time); K and V are
    # then the values a bf16 cache keeps
    prompt_dtype = (prompt_attention(nh, nkv, hd, x.device) if causal and mlp_bf16 is not None
                    and attention_dtype == torch.float32 else attention_dtype)
    stack = (_q4_stack(model, projs, live.numel() if skip else B * N) if fused and fused_mlp
             and attention_dtype == torch.float32 and attention_ours(nh, nkv, hd, nodes, caches[0][0].dtype)
             and kernels.layers_here() else None)
    # a prompt's rotation as one op too (csrc/rope.cpp: q, k rotated and v transposed, the same numbers), its own
    # K/V then written to the cache and attended over
    return _Plan(fused=fused, prompt_rope=rope_op and causal, fused_mlp=fused_mlp, skip=skip,
                           mlp_bf16=mlp_bf16, nodes=nodes, prompt_dtype=prompt_dtype, stack=stack)


def _real_nodes(B: int, N: int, live: torch.Tensor):
    """f -> f over a batch's real nodes only (`live`: flat indices into B * N), its pads' outputs 0: the eager
    layers skip the pads, each linear taking the path of that many rows."""
    flat = B * N

    def real(f):
        def run(h):
            y = f(h.reshape(flat, -1)[live])
            return y.new_zeros(flat, y.shape[-1]).index_copy_(0, live, y).view(B, N, -1)
        return run
    return real


def _attention(att, heads, plan, geometry: tuple, rows_cos, rows_sin, K, V, slots, n_keys: int, attn_mask,
               causal: bool, segments) -> torch.Tensor:
    """One layer's attention from its projected heads (B, N, nh + 2 nkv, hd): q and k rotated (and normed: Qwen3),
    the new K/V written to the cache at `slots` (a packed prompt's into its own row), then attention over the
    cache (or a prompt over its own K/V). Returns (B, N, nh, hd)."""
    nh, nkv, hd, scaling, qk_norm, aux_layers, attention_dtype = geometry
    cos, sin = rows_cos[:, None], rows_sin[:, None]  # (B, 1, N, hd)
    N = heads.shape[1]
    if plan.fused and heads.is_contiguous():
        q = torch.ops.dart_lab.rope_cache(heads, rows_cos, rows_sin, K, V, slots, nh, nkv)
    else:
        if plan.prompt_rope and heads.is_contiguous():  # vt: v as (B, kv heads, N, hd)
            q, k, vt = torch.ops.dart_lab.rope_heads(heads, rows_cos, rows_sin, nh, nkv)
        elif qk_norm:
            q, k = _rms_norm(att.q_norm, heads[:, :, :nh]), _rms_norm(att.k_norm, heads[:, :, nh:nh + nkv])
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            vt = heads[:, :, nh + nkv:].transpose(1, 2)
        else:  # q and k side by side in the projection's output: rotated in one pass
            qk = _rotate(heads[:, :, :nh + nkv].transpose(1, 2), cos, sin)
            q, k, vt = qk[:, :nh], qk[:, nh:], heads[:, :, nh + nkv:].transpose(1, 2)
        if segments is None:
            K.index_copy_(2, slots, k.to(K.dtype))
            V.index_copy_(2, slots, vt.to(V.dtype))
        else:  # prompt r into cache row r (copy_ rounds to the cache's dtype as .to does)
            for r, (s, e) in enumerate(segments):
                K[r, :, :e - s].copy_(k[0, :, s:e])
                V[r, :, :e - s].copy_(vt[0, :, s:e])
    if not causal:
        return attend(q.to(attention_dtype), K, V, attn_mask, n_keys, scaling, causal, plan.nodes).transpose(1, 2)
    # a prompt into an empty cache: its own K/V are every key
    qa, ka, va = q.to(plan.prompt_dtype), k.to(plan.prompt_dtype), vt.to(plan.prompt_dtype)
    if segments is None:
        return attend(qa, ka, va, None, n_keys, scaling, causal).transpose(1, 2)
    o = torch.empty(1, N, nh, hd, dtype=qa.dtype, device=qa.device)  # each prompt's heads where o_proj reads them
    for s, e in segments:
        o[0, s:e] = attend(qa[:, :, s:e], ka[:, :, s:e], va[:, :, s:e], None, e - s, scaling, causal)[0].transpose(0, 1)
    return o


def _mlp(layer, gate_up, down, plan):
    """The layer's MLP as one callable on the post-attention-normed x: both on bf16 copies (silu * up from bf16 to
    bf16, the same numbers: csrc/norm.cpp), torch's silu and mul as one dispatch, or the module's own ops."""
    if plan.mlp_bf16 is not None:
        g, d = gate_up.paths[plan.mlp_bf16[0]], down.paths[plan.mlp_bf16[1]]
        return lambda h: d.raw(torch.ops.dart_lab.silu_mul_bf16.default(g.raw(h.to(torch.bfloat16)))).to(h.dtype)
    if plan.fused_mlp:
        return lambda h: down(torch.ops.dart_lab.silu_mul.default(gate_up(h)))

    def mlp(h):
        gate, up = gate_up(h).chunk(2, dim=-1)
        return down(layer.mlp.act_fn(gate) * up)
    return mlp


_stacks = weakref.WeakKeyDictionary()  # a step's first linear -> {rows' paths: q4_layers' weight arguments}


def _q4_stack(model, projs, rows: int) -> tuple | None:
    """`dart_lab::q4_layers`' per-layer arguments (norm weights, eps, and q4mm's wp, sl, n_out, halves, bias for
    q|k|v, o, gate|up, down) where each linear takes our 4-bit kernel (`Q4Linear`) for `rows` rows and every
    norm is an fp32 RMSNorm of one eps; else None. Built once per projections and paths, kept as long as the
    projections live."""
    def q4(f):
        f = f.paths[f.path(rows)] if isinstance(f, ByRows) else f
        return f if isinstance(f, Q4Linear) else None

    sig = tuple(f.path(rows) if isinstance(f, ByRows) else type(f).__name__ for f in projs[0])
    try:
        held = _stacks.setdefault(projs[0][0], {})
    except TypeError:  # a linear that cannot be weakly referenced: not one of ours
        return None
    if sig not in held:
        lins = [q4(f) for row in projs for f in row]
        norms = [n for l in model.model.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
        eps = {getattr(n, "variance_epsilon", None) for n in norms}
        ok = (all(lins) and len(eps) == 1 and None not in eps
              and all(getattr(n, "weight", None) is not None and n.weight.dtype == torch.float32 for n in norms))
        held[sig] = (([n.weight for n in norms], float(eps.pop()), [f.wp for f in lins], [f.sl for f in lins],
                      [f.out_features for f in lins], [f.halves for f in lins], [f.b for f in lins])
                     if ok else None)
    return held[sig]



def _fused_linear(*mods: torch.nn.Linear) -> torch.nn.Linear:
    """One nn.Linear computing `mods` (reading the same input) side by side: a copy of their weights."""
    w = torch.cat([m.weight.detach() for m in mods])
    out = torch.nn.Linear(w.shape[1], w.shape[0], bias=mods[0].bias is not None, dtype=w.dtype, device=w.device)
    out.weight = torch.nn.Parameter(w, requires_grad=False)
    if mods[0].bias is not None:
        out.bias = torch.nn.Parameter(torch.cat([m.bias.detach() for m in mods]), requires_grad=False)
    return out


# whether this torch can check only the guards that tell a function's cached graphs apart (2.7+); asked
# once, not at every step
_CAN_SKIP_GUARDS = "skip_guard_eval_unsafe" in inspect.signature(
    getattr(torch.compiler, "set_stance", lambda: None)).parameters


def _skipping_guards():
    """A context in which dynamo checks only the guards that tell a function's cached graphs apart
    (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`), where this torch has it; else nothing."""
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True) if _CAN_SKIP_GUARDS else contextlib.nullcontext()


class StepGraph(torch.nn.Module):
    """`decoder_step` for `torch.compile` (FastTarget.compile): q|k|v and gate|up as fused nn.Linear
    copies, compiled with inductor's freezing (the weights become constants; on a CPU inductor packs
    them for oneDNN, as PackedLinear does eagerly) and static shapes but the number of keys attention
    reads: one graph per node bucket, the key count a symbol (`n_keys` None), or static too, one graph per
    (node bucket, key bucket) (`n_keys` the bucket). Compiled on first use; `shapes` lists the
    (node bucket, key bucket or None) seen (tests count real compilations)."""

    graphs_allowed = 0  # dynamo's recompile limit, summed over the modules built in this process

    def __init__(self, target, key) -> None:
        super().__init__()
        layers = target.model.model.layers
        self.target_model = target.model
        self.qkv = torch.nn.ModuleList(_fused_linear(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)
                                       for l in layers)
        self.gate_up = torch.nn.ModuleList(_fused_linear(l.mlp.gate_proj, l.mlp.up_proj) for l in layers)
        self.geometry, self.key, self.shapes = target._geometry(), key, set()
        # 4-bit weights: the int4 kernel's calls stay as they are in the graph, the ops between them fuse;
        # with `int4_paths` "measured" each linear takes the path its table measured fastest for the
        # bucket's rows, as an eager step does (`_measured_paths`), else 4 bits at every width
        self.int4 = None
        if target.weights == "int4":
            self.int4 = (self._measured_paths(target) if target.int4_paths == "measured"
                         else target._int4(by_rows=False))
        self.eval()
        # kept out of the module registry (a compiled module holding itself would loop in .modules())
        # mode "reduce-overhead" (`FastTarget.compile_mode`, CUDA): each shape's graph replayed as a CUDA graph,
        # one launch a step instead of one a kernel
        object.__setattr__(self, "_compiled", torch.compile(self, dynamic=False, fullgraph=True,
                                                            mode=getattr(target, "compile_mode", None)))
        # one graph per shape: allow as many as the buckets can make without falling back to eager, for this
        # module and every one built before it in this process (their graphs share dynamo's code objects)
        key_buckets = target.compile_capacity // target.key_bucket + 1 if target.key_bucket else 1
        StepGraph.graphs_allowed += len(target.node_buckets) * key_buckets
        need = StepGraph.graphs_allowed
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, need)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4 * need)

    def _measured_paths(self, target) -> tuple[list, "ByRows"]:
        """The 4-bit target's (layers, head) for a graph: every linear a `ByRows` over the tables `int4_by_rows`
        measured (cached per machine), its paths written so inductor can compile them -- the 4-bit kernel
        as is, the dense weights as the fused nn.Linear copies, bf16 as nn.Linear copies that freezing packs
        for oneDNN (what `PackedLinear` does eagerly). A wide tree's LM head, for one, is 2-3x cheaper in
        packed bf16 than in 4-bit halves on a CPU with bf16 units (docs/speed.md)."""
        layers4, head4 = target._int4(by_rows=False)
        target._int4(by_rows=True)  # the tables: measured once per machine, then read from the cache
        tables = target.dtype_report["int4"]["by_rows"]["tables"]
        dense_name = dtype_name(target.model.lm_head.weight.dtype)
        self.bf16 = torch.nn.ModuleList()  # bf16 copies, only of what some row count takes

        def bf16(lin: torch.nn.Linear):
            copy = _fused_linear(lin).to(torch.bfloat16)
            self.bf16.append(copy)
            return lambda x: copy(x.to(torch.bfloat16)).to(x.dtype)

        def by_rows(table, paths: dict, bf16_name: str, dense: torch.nn.Linear) -> ByRows:
            used = {n for _, n in table}
            return ByRows({n: bf16(dense) if n == bf16_name else paths[n] for n in used}, tuple(table))

        layers = []
        for i, l in enumerate(target.model.model.layers):
            dense = (self.qkv[i], l.self_attn.o_proj, self.gate_up[i], l.mlp.down_proj)
            layers.append(tuple(by_rows(tables[kind], {"int4": layers4[i][j], "q4": getattr(layers4[i][j], "q4", None),
                                                       dense_name: dense[j]}, "bf16", dense[j])
                                for j, kind in enumerate(("qkv", "o", "gate_up", "down"))))
        head = by_rows(tables["lm_head"], {**head4.paths, dense_name: target.model.lm_head}, "bf16 packed",
                       target.model.lm_head)
        return layers, head

    def forward(self, ids, positions, slots, attn_mask, ks, vs, n_keys: int | None):
        if n_keys is None:  # the mask's width, a symbol in the graph (`run`)
            n_keys = attn_mask.shape[-1]
        if self.int4 is not None:
            projs, head = self.int4
        else:
            projs = [(self.qkv[i], l.self_attn.o_proj, self.gate_up[i], l.mlp.down_proj)
                     for i, l in enumerate(self.target_model.model.layers)]
            head = self.target_model.lm_head
        return decoder_step(self.target_model, projs, head, self.geometry, ids, positions, slots, (ks, vs), n_keys,
                            attn_mask)

    def run(self, ids, positions, slots, attn_mask, ks, vs, n_keys: int | None):
        """(logits (Nb, V), aux (Nb, 3H)) for a padded step; Nb = ids.numel(). attn_mask (1, 1, Nb, K):
        attention reads cache slots [0, K); n_keys None: K varies from call to call in one graph, else
        n_keys == K, a static shape."""
        shape = (ids.numel(), n_keys)
        if shape in self.shapes:
            # a shape this module already compiled: dynamo checks only the guards that tell its cached graphs
            # apart (checking every guard is a visible share of a small compiled step: docs/speed.md).
            # Safe here because nothing else a guard watches changes between calls: the caches are allocated
            # once at `compile_capacity`, the weights are frozen into this module's graphs and a weight
            # change builds a new module (`FastTarget._graph`), whose first call of each shape compiles with
            # every guard checked (tests/test_fast_runner.py)
            with _skipping_guards():
                return self._compiled(ids, positions, slots, attn_mask, ks, vs, n_keys)
        self.shapes.add(shape)
        if n_keys is None:  # compiled with the key count symbolic: any K up to the cache's slots reuses it
            torch._dynamo.mark_dynamic(attn_mask, 3)
        # freezing is read while compiling (passed through torch.compile's `options` it did not reach the
        # compiler: the linears stayed aten::mm, unpacked), so it is set around the call that compiles
        # int4's head mixes fp16 (one row) and bf16 (the 4-bit kernel's activations) by design
        with torch._inductor.config.patch(freezing=True), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed")
            return self._compiled(ids, positions, slots, attn_mask, ks, vs, n_keys)
