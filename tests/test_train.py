"""Training invariants: KL of an exact draft is zero, gamma weighting, the prefix-shared block mask,
a smoke run lowers the loss, resume == uninterrupted, vocab round trip, tolerant ShareGPT parsing."""
import json
import math

import pytest
import torch

from conftest import tiny_target
from dart_lab import DartLabError
from dart_lab.data import iter_sharegpt
from dart_lab.features import FeatureDataset, write_features
from dart_lab.config import TrainConfig
from dart_lab.losses import _kl, acceptance_stats, dart_block_layout, dart_loss, eagle3_loss, soft_cross_entropy, teacher_probs
from dart_lab.train import build_head, train_head


def test_kl_of_draft_equal_to_target_is_zero():
    logits = torch.randn(7, 50)
    q = torch.softmax(logits, -1)
    assert _kl(q, logits).abs().max() < 1e-5
    assert (_kl(q, logits + torch.randn(7, 50)) > 0).all()


def test_restricted_target_law_equals_renormalised_full_softmax():
    final, w = torch.randn(5, 16), torch.randn(40, 16)
    ids = torch.tensor([1, 3, 8, 20, 39])
    full = torch.softmax(final @ w.t(), -1)[:, ids]
    torch.testing.assert_close(teacher_probs(final, w, ids), full / full.sum(-1, keepdim=True))


def test_block_mask_sees_own_prefix_and_earlier_masks_of_its_block():
    T, m = 12, 3
    anchors = torch.tensor([2, 5, 9])
    pos, mask = dart_block_layout(T, anchors, m)
    n = T - 1
    assert torch.equal(mask[:n, :n], torch.ones(n, n, dtype=torch.bool).tril())
    assert not mask[:n, n:].any()  # the prefix never sees masks
    for a, i in enumerate(anchors.tolist()):
        for j in range(m):
            row = mask[n + a * m + j]
            expected = torch.zeros(n + 3 * m, dtype=torch.bool)
            expected[: i + 1] = True
            expected[n + a * m: n + a * m + j + 1] = True
            assert torch.equal(row, expected), (i, j)
            assert pos[n + a * m + j] == i + 1 + j


@pytest.fixture(scope="module")
def tiny_features(tmp_path_factory):
    target = tiny_target("llama")
    g = torch.Generator().manual_seed(0)
    # a learnable toy language: a repeating pattern with noise, assistant mask on the second half
    examples = []
    for k in range(24):
        base = torch.randint(2, 12, (6,), generator=g).tolist()
        ids = (base * 8)[:40]
        examples.append((f"ex{k}", ids, [False] * 10 + [True] * 30))
    root = tmp_path_factory.mktemp("feat")
    write_features(target, iter(examples[:20]), root, 20, "train", shard_size=8, progress=False)
    write_features(target, iter(examples[20:]), root, 4, "val", shard_size=8, progress=False)
    return target, root


def test_gamma_weights_the_levels(tiny_features):
    target, root = tiny_features
    ex = FeatureDataset(root / "train")[0]
    d2t = torch.arange(target.vocab_size)
    emb, w = target.model.get_input_embeddings(), target.model.get_output_embeddings().weight.detach()
    for gamma in (0.6, 1.0):
        cfg = TrainConfig(gamma=gamma, draft_length=3, draft_vocab_size=target.vocab_size)
        head = build_head(target, cfg, d2t)
        loss, stats = dart_loss(head, ex, emb, w, d2t, cfg, torch.Generator().manual_seed(0), "cpu")
        expect = sum(gamma ** t * v for t, v in stats["level_kl"].items())
        torch.testing.assert_close(loss, expect)
        assert len(stats["level_kl"]) == 4


@pytest.mark.parametrize("shifted", [True, False])
def test_block_training_loss_equals_loss_of_inference_forwards(tiny_features, shifted):
    """Every anchor's mask block in the batched training layout gives the logits of an inference
    forward over that anchor's prefix (shifted: level 0 from the last prefix position; unshifted,
    Table 3: from the first of draft_length+1 masks)."""
    target, root = tiny_features
    ex = FeatureDataset(root / "train")[1]
    d2t = torch.arange(target.vocab_size)
    emb, w = target.model.get_input_embeddings(), target.model.get_output_embeddings().weight.detach()
    cfg = TrainConfig(gamma=0.7, draft_length=3, draft_vocab_size=target.vocab_size, anchors_per_seq=10_000,
                      shifted=shifted)
    head = build_head(target, cfg, d2t).eval()
    torch.nn.init.normal_(head.midlayer.mask_rep, std=0.5)  # masks that matter
    loss, _ = dart_loss(head, ex, emb, w, d2t, cfg, torch.Generator().manual_seed(0), "cpu")
    ids, lm = ex["input_ids"].long(), ex["loss_mask"]
    T = ids.numel()
    q = teacher_probs(ex["final"], w, d2t)
    per_level = {j: [] for j in range(4)}
    for i in range(T - 2):
        if not lm[i + 2]:
            continue
        with torch.no_grad():
            logits, _ = head(ex["aux"][None, :i + 1].float(), ids[None, 1:i + 2], torch.arange(i + 1 + head.cfg.n_masks))
        assert logits.shape[1] == 4
        for j in range(4):
            if i + 2 + j < T and lm[i + 2 + j]:
                per_level[j].append(_kl(q[i + 1 + j][None], logits[0, j][None])[0])
    ref = sum(0.7 ** j * torch.stack(v).mean() for j, v in per_level.items() if v)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-4, atol=1e-5)


def test_eagle3_training_loss_equals_loss_of_inference_forwards(tiny_features):
    """The batched training-time-test unroll (all anchors in one forward per step, [K0 causal | own
    keys of earlier steps]) gives, for every anchor, the logits of running its chain through the
    head the way the drafter does: the prefix, then one token at a time on the head's own output."""
    target, root = tiny_features
    ex = FeatureDataset(root / "train")[1]
    d2t = torch.arange(target.vocab_size)
    emb, w = target.model.get_input_embeddings(), target.model.get_output_embeddings().weight.detach()
    cfg = TrainConfig(kind="eagle3", ttt_steps=3, ttt_decay=0.8, draft_vocab_size=target.vocab_size)
    head = build_head(target, cfg, d2t).eval()
    loss, _ = eagle3_loss(head, ex, emb, w, d2t, cfg, torch.Generator().manual_seed(0), "cpu")
    ids, lm = ex["input_ids"].long(), ex["loss_mask"]
    T = ids.numel()
    q = teacher_probs(ex["final"], w, d2t)
    per_step = {s: [] for s in range(cfg.ttt_steps)}
    with torch.no_grad():
        for i in range(T - 1):
            logits, h, past = head(ex["aux"][None, :i + 1].float(), ids[None, 1:i + 2], torch.arange(i + 1))
            logits, h = logits[:, -1:], h[:, -1:]
            for s in range(cfg.ttt_steps):
                if s:  # one more token on the chain: the head's own output and the token it predicted for
                    if i + 1 + s >= T:
                        break
                    logits, h, kv = head(h, ids[None, i + 1 + s:i + 2 + s], torch.tensor([i + s]), past_kv=past,
                                         from_target=False)
                    past = (torch.cat([past[0], kv[0]], -2), torch.cat([past[1], kv[1]], -2))
                tgt = i + 1 + s
                if tgt + 1 < T and lm[tgt + 1]:
                    per_step[s].append(-(q[tgt] * torch.log_softmax(logits[0, 0].float(), -1)).sum())
    ref = sum(0.8 ** s * torch.stack(v).mean() for s, v in per_step.items() if v)
    assert len(per_step[2]) > 5
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["dart", "eagle3"])
def test_smoke_run_lowers_loss_and_resume_equals_uninterrupted(tiny_features, tmp_path, kind):
    target, root = tiny_features
    cfg = TrainConfig(kind=kind, max_steps=20, save_every=10, val_every=10, draft_length=3, ttt_steps=3,
                      draft_vocab_size=64, anchors_per_seq=8, warmup_steps=2, lr=3e-3, val_examples=4, autocast=False)
    full = train_head(target, root, tmp_path / "full", cfg, progress=False, log=lambda *a: None)
    log = [json.loads(line) for line in open(tmp_path / "full" / "log.jsonl")]
    first, last = sum(r["loss"] for r in log[:3]) / 3, sum(r["loss"] for r in log[-3:]) / 3
    # soft cross-entropy (EAGLE-3) has the target's entropy as its floor, so ask for an absolute drop
    assert last < first - 1.0, (first, last)
    assert "alpha" in full["validation"] and (tmp_path / "full" / "head" / "config.json").is_file()
    # killed 3 steps after its checkpoint at step 10, then resumed (steps 11-13 are redone)
    assert train_head(target, root, tmp_path / "resumed", cfg, progress=False, log=lambda *a: None, _stop_after=13) is None
    train_head(target, root, tmp_path / "resumed", cfg, progress=False, log=lambda *a: None)
    a = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)["head"]
    b = torch.load(tmp_path / "resumed" / "ckpt.pt", weights_only=False)["head"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the killed run's log lines past its checkpoint were dropped: the log reads as uninterrupted
    steps = [json.loads(line)["step"] for line in open(tmp_path / "resumed" / "log.jsonl")]
    assert steps == list(range(1, 21)), steps
    # --init-from continues from the exported head (bf16 on disk): with a negligible lr it stays there
    import dataclasses

    ft = dataclasses.replace(cfg, init_from=str(tmp_path / "full" / "head"), max_steps=2, lr=1e-12, warmup_steps=1)
    fts = train_head(target, root, tmp_path / "ft", ft, progress=False, log=lambda *a: None)
    # its summary and card count what the head had seen before (the run folder's summary.json)
    assert fts["before"] == {k: full[k] for k in ("tokens_seen", "steps", "wall_time_s")}
    assert fts["total"]["tokens_seen"] == full["tokens_seen"] + fts["tokens_seen"] and fts["total"]["steps"] == 22
    assert f"in all {fts['total']['tokens_seen']} tokens" in (tmp_path / "ft" / "head" / "README.md").read_text()
    c = torch.load(tmp_path / "ft" / "ckpt.pt", weights_only=False)["head"]
    for k in a:
        torch.testing.assert_close(c[k].float(), a[k].to(torch.bfloat16).float(), rtol=0, atol=1e-6, msg=k)


def test_a_finished_run_continues_with_a_longer_budget(tiny_features, tmp_path):
    """A run that ended (schedule done) resumes with more steps: the cosine is recomputed for the new
    length, the first continued step already uses it, and any other config change is refused."""
    import dataclasses

    target, root = tiny_features
    cfg = TrainConfig(max_steps=6, save_every=3, val_every=100, draft_length=3, draft_vocab_size=64,
                      anchors_per_seq=8, warmup_steps=2, lr=3e-3, val_examples=4, autocast=False)
    train_head(target, root, tmp_path / "run", cfg, progress=False, log=lambda *a: None)
    more = dataclasses.replace(cfg, max_steps=10, time_budget_min=5.0)
    lines = []
    train_head(target, root, tmp_path / "run", more, progress=False, log=lines.append)
    assert any("schedule extended: max_steps 6 -> 10" in m for m in lines), lines
    log = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert [r["step"] for r in log] == list(range(1, 11))
    assert log[5]["lr"] == 0.0 and log[6]["lr"] > 0  # the old schedule had ended; the new one goes on
    st = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert st["step"] == 10 and st["config"]["max_steps"] == 10
    with pytest.raises(DartLabError, match="different config"):
        train_head(target, root, tmp_path / "run", dataclasses.replace(more, lr=1e-3), progress=False,
                   log=lambda *a: None)


def test_vocab_round_trip():
    target = tiny_target("llama")
    ids = torch.tensor([0, 1, 5, 17, 40, 95])
    head = build_head(target, TrainConfig(draft_vocab_size=6), ids)
    assert head.draft_to_target().tolist() == ids.tolist()
    assert torch.nonzero(head.t2d).flatten().tolist() == ids.tolist()
    assert torch.equal(head.lm_head.weight, target.model.get_output_embeddings().weight[ids])


def test_acceptance_stats():
    c = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    s = acceptance_stats([c])
    assert s["alpha"] == [0.75, round(2 / 3, 4), 0.5]
    assert s["tau_chain"] == pytest.approx(1 + (2 + 1 + 0 + 3) / 4)
    # unconditional per-level accuracy and hit@10 count only the rows where a level is supervised
    v = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    h = c | torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    s = acceptance_stats([c], [h], [v])
    assert s["acc"] == [0.75, 0.75, 0.5] and s["hit10"] == [1.0, 1.0, 1.0]


def test_truncated_sharegpt_is_parsed_tolerantly(tmp_path):
    recs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    text = json.dumps(recs, indent=1)
    cut = text[: text.rindex('"a2"') + 2]  # cut inside the last record
    (tmp_path / "sg.json").write_text(cut)
    got = list(iter_sharegpt(tmp_path / "sg.json"))
    assert [r["id"] for r in got] == ["c0", "c1"]


def test_bad_training_input(tiny_features, tmp_path):
    target, root = tiny_features
    with pytest.raises(DartLabError, match="no feature shards"):
        train_head(target, tmp_path / "empty", tmp_path / "o", TrainConfig(max_steps=1), progress=False)
    other = tiny_target("llama", hidden=32)
    with pytest.raises(DartLabError, match="aux width"):
        train_head(other, root, tmp_path / "o2", TrainConfig(max_steps=1), progress=False)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os

        if os.geteuid() != 0:  # root can write anywhere; the check below still covers a file path
            with pytest.raises(DartLabError, match="not writable"):
                train_head(target, root, ro / "x", TrainConfig(max_steps=1), progress=False)
    finally:
        ro.chmod(0o700)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DartLabError, match="not writable"):
        train_head(target, root, blocker / "sub", TrainConfig(max_steps=1), progress=False)
    with pytest.raises(DartLabError, match="gamma"):
        TrainConfig(gamma=0.0)


def test_online_training_equals_training_from_an_fp32_cache(tmp_path):
    """Target in the loop computes exactly what the cache stores; both runs end in the same head."""
    from dart_lab.features import OnlineFeatures

    target = tiny_target("llama")
    g = torch.Generator().manual_seed(1)
    examples = [(f"e{k}", torch.randint(2, 90, (30,), generator=g).tolist(), [False] * 8 + [True] * 22) for k in range(6)]
    write_features(target, iter(examples[:4]), tmp_path / "c", 4, "train", dtype=torch.float32, progress=False)
    write_features(target, iter(examples[4:]), tmp_path / "c", 2, "val", dtype=torch.float32, progress=False)
    online = {"train": OnlineFeatures(target, examples[:4]), "val": OnlineFeatures(target, examples[4:])}
    cached = FeatureDataset(tmp_path / "c" / "train")
    for i in range(4):
        a, b = online["train"][i], cached[i]
        for k in a:
            assert torch.equal(a[k], b[k]), k
    cfg = TrainConfig(max_steps=4, draft_length=3, draft_vocab_size=48, anchors_per_seq=4, warmup_steps=1,
                      val_examples=2, val_every=2, autocast=False)
    s1 = train_head(target, tmp_path / "c", tmp_path / "off", cfg, progress=False, log=lambda *a: None)
    s2 = train_head(target, online, tmp_path / "on", cfg, progress=False, log=lambda *a: None)
    a = torch.load(tmp_path / "off" / "ckpt.pt", weights_only=False)["head"]
    b = torch.load(tmp_path / "on" / "ckpt.pt", weights_only=False)["head"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert s1["validation"] == s2["validation"] and s2["features"].startswith("online")
    # evaluating the final head afterwards reports what training reported
    from dart_lab.train import evaluate_head

    head = build_head(target, cfg, torch.arange(48))
    head.load_state_dict(a)
    assert evaluate_head(target, head, tmp_path / "c", "dart", num=2, anchors_per_seq=4) == s1["validation"]


def test_two_process_accelerate_launch_equals_one_process(tiny_features, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (on a CPU-only machine: torchrun, gloo, MULTI_CPU)
    with one sequence per process and step ends in the same head as one process with two sequences per
    step: same data, gradients averaged. (`--cpu` would start a single process without MPI.)"""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    _, root = tiny_features
    worker = Path(__file__).parent / "accelerate_worker.py"
    acc = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([acc, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
                        "no", "--dynamo_backend", "no", "--main_process_port", "29517", str(worker), str(root),
                        str(tmp_path / "two"), "1"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, str(worker), str(root), str(tmp_path / "one"), "2"], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    a = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "two" / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for k in a["head"]:
        torch.testing.assert_close(a["head"][k], b["head"][k], rtol=1e-4, atol=1e-5, msg=k)
    assert b["tokens_seen"] == a["tokens_seen"]  # both processes' sequences are counted
    # and the two processes really split the data: one process with one sequence per step differs
    r = subprocess.run([sys.executable, str(worker), str(root), str(tmp_path / "half"), "1"], capture_output=True,
                       text=True, timeout=600, env=env)
    c = torch.load(tmp_path / "half" / "ckpt.pt", weights_only=False)
    assert not torch.allclose(a["head"]["fc.weight"], c["head"]["fc.weight"], rtol=1e-4, atol=1e-5)


def test_cli_train_under_accelerate_launch_runs_two_processes(tiny_features, embedded, tmp_path):
    """`accelerate launch ... -m dart_lab train` is really distributed: 2 processes, one log line per step."""
    import os
    import shutil
    import subprocess
    import sys

    from conftest import tiny_model
    from dart_lab.loading import build_plain_cache

    _, root = tiny_features
    model_dir = build_plain_cache(tiny_model("llama"), embedded.tokenizer, tmp_path / "tiny", source="test")
    acc = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    r = subprocess.run([acc, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
                        "no", "--dynamo_backend", "no", "--main_process_port", "29519", "-m", "dart_lab", "train", "dart",
                        "--target", str(model_dir), "--dtype", "fp32", "--features", str(root), "--out",
                        str(tmp_path / "run"), "--max-steps", "3", "--draft-vocab-size", "64", "--draft-length", "3",
                        "--val-examples", "2"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 3
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 3


def test_soft_cross_entropy_gradient_is_autograds():
    """The hand-written backward of the fused cross-entropy equals autograd through the plain formula."""
    z = torch.randn(6, 40, dtype=torch.float64, requires_grad=True)
    q = torch.softmax(torch.randn(6, 40, dtype=torch.float64), -1)
    g = torch.randn(6, dtype=torch.float64)
    (soft_cross_entropy(z, q) * g).sum().backward()
    want = torch.autograd.grad((-(q * torch.log_softmax(z, -1)).sum(-1) * g).sum(), z)[0]
    torch.testing.assert_close(z.grad, want)
    assert torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, q), (z.detach().requires_grad_(),))


def test_learning_curve_extrapolation_recovers_a_log_law():
    from dart_lab.train import tokens_to_reach
    pts = [(t, 1.2 + 0.1 * math.log(t)) for t in (1e5, 3e5, 1e6, 3e6)]
    fit = tokens_to_reach(pts, goal=3.0)
    assert abs(fit["slope"] - 0.1) < 1e-9 and abs(math.log(fit["tokens"]) - 18.0) < 1e-6
    assert tokens_to_reach([(1e5, 2.0), (1e6, 1.9)], goal=3.0)["tokens"] is None  # never, on a falling curve
