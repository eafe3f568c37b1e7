"""The draft heads' training losses (paper section 3.4): DART's annealed forward KL over prefix-shared mask blocks,
EAGLE-3's training-time test, the target's teacher distributions over the draft vocabulary, and the acceptance
statistics a validation pass reports. The layout of both losses is the module docstring of `train.py`.
"""
from __future__ import annotations

import torch

from .config import TrainConfig
from .draft_head import DartHead, Eagle3Head
from .features import FeatureDataset


# ----------------------------------------------------------------------------- vocabulary
def token_ranks(ds: FeatureDataset, vocab: int, always=()) -> torch.Tensor:
    """(vocab,) rank of every target id by its count among assistant tokens (0 = most frequent; ties by
    id); the ids in `always` (EOS) rank first."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for i in range(len(ds)):
        ids, mask = ds.tokens(i)
        counts += torch.bincount(ids.long()[mask], minlength=vocab)
    for t in always:
        counts[t] = counts.max() + 1
    rank = torch.empty(vocab, dtype=torch.long)
    rank[torch.argsort(-counts, stable=True)] = torch.arange(vocab)
    return rank


def draft_vocab_from_features(ds: FeatureDataset, size: int, vocab: int, always=()) -> torch.Tensor:
    """The `size` most frequent target ids among assistant tokens (ties by id), plus `always` (EOS).
    Returned sorted ascending: draft id order = target id order."""
    return torch.nonzero(token_ranks(ds, vocab, always) < min(size, vocab)).flatten()


# ----------------------------------------------------------------------------- DART
def dart_block_layout(T: int, anchors: torch.Tensor, m: int):
    """Positions (n + A*m,) and boolean attention mask (n + A*m, n + A*m) for prefix length
    n = T-1 and mask blocks of m tokens at each anchor (see module docstring)."""
    n = T - 1
    A = anchors.numel()
    tot = n + A * m
    mask = torch.zeros(tot, tot, dtype=torch.bool)
    mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    pos = torch.empty(tot, dtype=torch.long)
    pos[:n] = torch.arange(n)
    blk = torch.ones(m, m, dtype=torch.bool).tril()
    for a, i in enumerate(anchors.tolist()):
        s = n + a * m
        mask[s:s + m, :i + 1] = True
        mask[s:s + m, s:s + m] = blk
        pos[s:s + m] = torch.arange(i + 1, i + 1 + m)
    return pos, mask


def teacher_probs(final: torch.Tensor, lm_head_w: torch.Tensor, d2t_ids: torch.Tensor) -> torch.Tensor:
    """final (T, H) -> target distribution restricted to the draft vocabulary, renormalised (T, Vd).
    softmax(full logits)[draft ids] / its sum == softmax over the draft ids' logits, so only those
    Vd columns of the target lm_head are computed."""
    logits = final.float() @ lm_head_w[d2t_ids].float().t()
    return torch.softmax(logits, dim=-1)


class _SoftCrossEntropy(torch.autograd.Function):
    """Per-row -sum_v q_v log softmax(z)_v, (R,), with the gradient written out: (softmax(z) - q) * g
    (rows of q sum to 1). One log-softmax forward and one subtraction backward -- autograd through
    log_softmax, a product and a sum keeps three (R, Vd) fp32 intermediates and runs ~6 passes."""

    @staticmethod
    def forward(ctx, z, q):
        logp = torch.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1)
        ctx.save_for_backward(logp, q)
        ctx.in_dtype = z.dtype
        return -(q * logp).sum(-1)

    @staticmethod
    def backward(ctx, g):
        logp, q = ctx.saved_tensors
        return ((logp.exp() - q) * g[:, None]).to(ctx.in_dtype), None


def soft_cross_entropy(logits: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(R, Vd) logits (any float type), (R, Vd) target law -> (R,) cross-entropy H(q, softmax(logits))."""
    return _SoftCrossEntropy.apply(logits, q)


def entropy(q: torch.Tensor) -> torch.Tensor:
    """(R, Vd) -> (R,) entropy of each row."""
    return -(q * torch.log(q.clamp_min(1e-12))).sum(-1)


def _kl(q: torch.Tensor, logits: torch.Tensor, ent: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row KL(q || softmax(logits)), (R,): the cross-entropy minus the target's entropy `ent` (a
    constant for the head, so the gradient is the cross-entropy's; pass it when it is known)."""
    return soft_cross_entropy(logits, q) - (entropy(q) if ent is None else ent)


def _agree(logits: torch.Tensor, q: torch.Tensor, k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(R,) bools: the target's argmax is the draft's top-1 / is among the draft's top-k (hit@k)."""
    t = q.argmax(-1)
    return logits.argmax(-1) == t, (logits.topk(min(k, logits.shape[-1]), -1).indices == t[:, None]).any(-1)


def dart_loss(head: DartHead, ex: dict, emb, lm_head_w, d2t_ids, cfg: TrainConfig, gen: torch.Generator,
              device, return_stats: bool = False):
    """Loss of one sequence (see the module docstring). Unshifted heads (cfg.shifted=False, Table 3
    ablation) take level 0 from the first of draft_length+1 masks instead of the last prefix position,
    so level 0 is supervised at the sampled anchors only. Every supervised row of every level goes
    through ONE lm_head matmul and one cross-entropy (rows weighted gamma^j / rows of level j)."""
    ids = ex["input_ids"].long().to(device)
    lmask = ex["loss_mask"].to(device)
    T = ids.numel()
    m = cfg.draft_length  # levels 0..m
    mb = m if cfg.shifted else m + 1  # masks per block
    n = T - 1
    # level 0 at prefix i predicts x_{i+2}: supervised where i+2 < T and x_{i+2} is an assistant token
    valid0 = torch.zeros(n, dtype=torch.bool, device=device)
    if T >= 3:
        valid0[:T - 2] = lmask[2:]
    cand = torch.nonzero(valid0).flatten().cpu()
    if cand.numel() == 0:
        return None
    q = teacher_probs(ex["final"].to(device), lm_head_w, d2t_ids)  # (T, Vd)
    A = min(cfg.anchors_per_seq, cand.numel())
    anchors = cand[torch.randperm(cand.numel(), generator=gen)[:A]].sort().values
    pos, amask = dart_block_layout(T, anchors, mb)
    hidden, _ = head(ex["aux"][None, :n].to(device, head.fc.weight.dtype), ids[None, 1:], pos.to(device),
                     n_masks=A * mb, attn_mask=amask.to(device), return_all=True, return_hidden=True)
    hidden = hidden[0]
    rows, qidx, oks = _supervised_rows(anchors, valid0, lmask, m, mb, cfg.shifted, device)
    counts = [r.numel() for r in rows]
    level = torch.repeat_interleave(torch.arange(m + 1, device=device), torch.tensor(counts, device=device))
    logits = head.lm_head(hidden[torch.cat(rows)])  # (R, Vd): lm_head only where a loss is taken
    qi = torch.cat(qidx)
    qr = q[qi]
    kl = _kl(qr, logits, entropy(q)[qi])  # entropy over the T rows, not the R (~2T) supervised ones
    per_level = torch.zeros(m + 1, device=device).index_add(0, level, kl) / torch.tensor(counts, device=device).clamp_min(1)
    present = torch.tensor([c > 0 for c in counts], device=device)
    loss = (torch.tensor([cfg.gamma ** j for j in range(m + 1)], device=device) * per_level)[present].sum()
    stats = {"level_kl": {j: per_level[j] for j in range(m + 1) if counts[j]}}
    if return_stats:
        stats.update(_anchor_stats(logits.detach(), qr, counts, rows, oks, anchors, cfg.shifted, device))
    return loss, stats


def _supervised_rows(anchors: torch.Tensor, valid0: torch.Tensor, lmask: torch.Tensor, m: int, mb: int, shifted: bool,
                     device) -> tuple[list, list, list]:
    """`dart_loss`'s supervised rows of the head's hidden states, level by level: rows[j] (indices into the n
    prefix rows then A blocks of mb masks), qidx[j] (the target law each row is held to), oks[j] (A,) which
    anchors level j supervises (level j at anchor i predicts x_{i+2+j}, target law q_{i+1+j})."""
    n, A, T = valid0.numel(), anchors.numel(), lmask.numel()
    rows, qidx, oks = [], [], []
    for j in range(m + 1):
        if j == 0 and shifted:  # every supervised prefix position, not only the anchors
            r0 = torch.nonzero(valid0).flatten()
            rows.append(r0)
            qidx.append(r0 + 1)
            oks.append(torch.ones(A, dtype=torch.bool))
            continue
        tgt = anchors + 1 + j  # q index; predicted token x_{tgt+1}
        ok = tgt + 1 < T
        ok[ok.clone()] = lmask[(tgt + 1)[ok].to(device)].cpu()
        mask_k = j if shifted else j + 1  # which mask of the block (1-based) predicts level j
        rows.append((n + torch.arange(A) * mb + (mask_k - 1))[ok].to(device))
        qidx.append(tgt[ok].to(device))
        oks.append(ok)
    return rows, qidx, oks


def _anchor_stats(logits, qr, counts, rows, oks, anchors, shifted: bool, device) -> dict:
    """(A, m+1) per anchor and level: top-1 agreement with the target law, hit@10, whether the level was supervised."""
    A = anchors.numel()
    top1, h10 = _agree(logits, qr)
    correct, hit, valid = [], [], []
    for j, (t1, hk) in enumerate(zip(top1.split(counts), h10.split(counts))):
        c = torch.zeros(A, dtype=torch.bool, device=device)
        h = torch.zeros(A, dtype=torch.bool, device=device)
        ok = oks[j].to(device)
        if j == 0 and shifted:  # anchors are a subset of the level-0 rows
            pick = torch.searchsorted(rows[0], anchors.to(device))
            c, h = t1[pick], hk[pick]
        else:
            c[ok], h[ok] = t1, hk
        correct.append(c)
        hit.append(h)
        valid.append(ok)
    return {"correct": torch.stack(correct, 1).cpu(), "hit10": torch.stack(hit, 1).cpu(), "valid": torch.stack(valid, 1).cpu()}


# ----------------------------------------------------------------------------- EAGLE-3
def eagle3_loss(head: Eagle3Head, ex: dict, emb, lm_head_w, d2t_ids, cfg: TrainConfig, gen, device,
                return_stats: bool = False):
    ids = ex["input_ids"].long().to(device)
    lmask = ex["loss_mask"].to(device)
    T = ids.numel()
    n = T - 1
    if T < 3 or not lmask[2:].any():
        return None
    q = teacher_probs(ex["final"].to(device), lm_head_w, d2t_ids)
    dt = head.fc.weight.dtype
    hidden = ex["aux"][None, :n].to(device, dt)  # step 0 reads the target's aux states (B=1, n, 3H)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    ks, vs = [], []
    terms, correct, hit, valid = [], [], [], []
    for s in range(cfg.ttt_steps):
        # inputs at step s, position i: token x_{i+1+s}; predicts x_{i+2+s} -> q_{i+1+s}. Position i
        # attends causally to step-0 keys and to its own keys of steps 1..s: the chain of anchor i,
        # exactly what the inference forward of step s sees (one head forward for all anchors)
        tok_idx = torch.arange(n, device=device) + 1 + s
        inb = tok_idx < T
        tok = ids[tok_idx.clamp_max(T - 1)]
        mask = torch.cat([causal] + [eye] * len(ks), dim=1)  # [K0 causal | K1..Ks own position]
        past = (torch.cat(ks, -2), torch.cat(vs, -2)) if ks else None
        _, h, kv = head(hidden, tok[None], torch.arange(n, device=device) + s, past_kv=past, attn_mask=mask,
                        from_target=(s == 0), logits=False)
        ks.append(kv[0])
        vs.append(kv[1])
        tgt = torch.arange(n, device=device) + 1 + s
        ok = (tgt + 1 < T) & inb
        ok = ok & lmask[(tgt + 1).clamp_max(T - 1)]
        c = torch.zeros(n, dtype=torch.bool, device=device)
        hh = torch.zeros(n, dtype=torch.bool, device=device)
        if ok.any():
            logits = head.lm_head(head.norm(h[0, ok]))  # lm_head only where a loss is taken
            qq = q[tgt[ok]]
            ce = soft_cross_entropy(logits, qq)
            terms.append((cfg.ttt_decay ** s) * ce.mean())
            if return_stats:
                c[ok], hh[ok] = _agree(logits.detach(), qq)
        correct.append(c & ok)
        hit.append(hh & ok)
        valid.append(ok)
        hidden = h
    if not terms:
        return None
    stats = {}
    if return_stats:
        # anchors = positions whose level-0 target is supervised
        valid0 = torch.zeros(n, dtype=torch.bool, device=device)
        valid0[:T - 2] = lmask[2:]
        stats.update(correct=torch.stack(correct, 1)[valid0].cpu(), hit10=torch.stack(hit, 1)[valid0].cpu(),
                     valid=torch.stack(valid, 1)[valid0].cpu())
    return sum(terms), stats


# ----------------------------------------------------------------------------- loop
def acceptance_stats(correct_rows: list[torch.Tensor], hit_rows=None, valid_rows=None) -> dict:
    """Per level k (rows = anchors, columns = levels):
    alpha_k = P(level k correct | levels < k correct) (a chain's acceptance rate), the simulated chain
    tau (= 1 + expected number of leading correct levels: greedy, one path, bonus included), and with
    hit/valid rows: acc_k = P(level k top-1 correct) and hit10_k = P(target token in the draft's top 10)
    over anchors where level k is supervised, regardless of earlier levels (paper Tables 3-4 style)."""
    if not correct_rows:
        return {}
    c = torch.cat(correct_rows).bool()
    extra = {}
    if hit_rows is not None and valid_rows is not None:
        h, v = torch.cat(hit_rows).bool(), torch.cat(valid_rows).bool()
        den = v.sum(0).clamp_min(1).float()
        extra = {"acc": [round(x, 4) for x in ((c & v).sum(0) / den).tolist()],
                 "hit10": [round(x, 4) for x in ((h & v).sum(0) / den).tolist()]}
    lead = torch.cumprod(c.int(), dim=1)
    alphas = []
    for k in range(c.shape[1]):
        prev = lead[:, k - 1].bool() if k else torch.ones(c.shape[0], dtype=torch.bool)
        alphas.append(round((c[prev, k].float().mean().item() if prev.any() else 0.0), 4))
    return {"alpha": alphas, "tau_chain": round(1.0 + lead.sum(1).float().mean().item(), 4), "anchors": int(c.shape[0]),
            **extra}
