"""Training invariants: KL of an exact draft is zero, gamma weighting, the prefix-shared block mask,
a smoke run lowers the loss, resume == uninterrupted, vocab round trip, tolerant ShareGPT parsing."""
import json

import pytest
import torch

from conftest import tiny_target
from dart_lab import DartLabError
from dart_lab.data import iter_sharegpt
from dart_lab.features import FeatureDataset, write_features
from dart_lab.train import (TrainConfig, _kl, _target_probs, acceptance_stats, build_head, dart_block_layout,
                            dart_loss, train_head)


def test_kl_of_draft_equal_to_target_is_zero():
    logits = torch.randn(7, 50)
    q = torch.softmax(logits, -1)
    assert _kl(q, logits).abs().max() < 1e-5
    assert (_kl(q, logits + torch.randn(7, 50)) > 0).all()


def test_restricted_target_law_equals_renormalised_full_softmax():
    final, w = torch.randn(5, 16), torch.randn(40, 16)
    ids = torch.tensor([1, 3, 8, 20, 39])
    full = torch.softmax(final @ w.t(), -1)[:, ids]
    torch.testing.assert_close(_target_probs(final, w, ids), full / full.sum(-1, keepdim=True))


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
    # interrupted after 10 steps (a checkpoint was just written), then resumed
    assert train_head(target, root, tmp_path / "resumed", cfg, progress=False, log=lambda *a: None, _stop_after=10) is None
    train_head(target, root, tmp_path / "resumed", cfg, progress=False, log=lambda *a: None)
    a = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=False)["head"]
    b = torch.load(tmp_path / "resumed" / "ckpt.pt", weights_only=False)["head"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


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
