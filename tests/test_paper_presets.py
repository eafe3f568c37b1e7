"""The GPU box's path, rehearsed offline: a hub cache with every paper artifact in its released form
(tests/fake_hub.py), HF_HUB_OFFLINE=1, and the paper preset's reproduction end to end; each artifact's loader
against what was written; a bad artifact as one line; the trie reader; the GPU checks that need no GPU."""
from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import fake_hub
from dart_lab import loading
from dart_lab.engine import kernels
from dart_lab.draft_head import DartHead, Eagle3Head
from dart_lab.errors import DartLabError
from dart_lab.methods import load_head
from dart_lab.ngram import NGram, _trie_nodes, read_trie, write_trie

REPO = Path(__file__).resolve().parent.parent
DATASETS = {"alpaca", "code_alpaca", "humaneval", "livecodebench", "math500", "mbpp", "mt_bench"}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, monkeypatch_module):
    """The fake hub cache, and this process reading only it (as the rehearsal's subprocesses do)."""
    cache = fake_hub.build(tmp_path_factory.mktemp("hub"))
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c
    monkeypatch_module.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch_module.setattr(c, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _env(cache: Path, tmp: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "DART_LAB_CACHE": str(tmp / "dlc"),
            "PYTHONPATH": str(REPO)}


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_the_paper_preset_reproduces_offline_from_the_hub_cache(hub_cache, tmp_path):
    """`papermill reproduce/run_all.ipynb -p preset paper-qwen3-4b -p smoke True` with HF_HUB_OFFLINE=1 reads the
    target, both heads, the trie and all seven prompt sets from the cache, and writes Tables 1-7 beside the
    paper's Qwen3-4B numbers; greedy rows equal AR token for token (fp32)."""
    results = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "papermill", "run_all.ipynb", str(tmp_path / "out.ipynb"), "-p", "preset",
                        "paper-qwen3-4b", "-p", "smoke", "True", "-p", "results_dir", str(results), "--cwd", "."],
                       cwd=REPO / "reproduce", env=_env(hub_cache, tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = next((results / "local" / "paper-qwen3-4b-smoke").iterdir())
    t1 = _rows(out / "table1.csv")
    assert {x["dataset"] for x in t1} == DATASETS
    assert {(x["method"], x["temperature"]) for x in t1} == {(m, t) for m in ("dart", "dart-no-ngram", "eagle3")
                                                              for t in ("0.0", "1.0")}
    assert all(float(x["match_ar"]) == 1.0 for x in t1 if x["temperature"] == "0.0")
    paper = json.loads((REPO / "dart_lab" / "paper" / "paper_tables.json").read_text())
    want = next(p for p in paper["table1_speedup"] if p["model"] == "qwen3-4b" and p["method"] == "dart"
                and p["temperature"] == 0.0)["speedup"]
    got = {x["dataset"]: float(x["paper_speedup"]) for x in t1 if x["method"] == "dart" and x["temperature"] == "0.0"}
    assert got == {d: want[d] for d in DATASETS}
    bench = [json.loads(p.read_text()) for p in (out / "bench").glob("*.json")]
    opts = {json.dumps(b["config"]["options"], sort_keys=True) for b in bench}
    assert all('"dart_head": "fvliang/qwen4b-dart"' in o and '"eagle3_head": "AngelSlim/Qwen3-4B_eagle3"' in o
               and '"ngram": "hub:fvliang/dart-qwen3-ngram/full.trie"' in o for o in opts)
    assert {b["config"]["model"] for b in bench} == {"Qwen/Qwen3-4B"}
    t2 = _rows(out / "table2.csv")
    assert {x["dataset"] for x in t2} == DATASETS and all(float(x["tau_with_ngram"]) >= 1 for x in t2)
    assert len(_rows(out / "table3.csv")) == 2 and len(_rows(out / "table4.csv")) == len(paper["table4_gamma"]["rows"])
    t57 = _rows(out / "tables5_7.csv")
    assert {(x["batch"], x["method"]) for x in t57} == {(b, m) for b in ("1", "2") for m in ("ar", "dart", "hf", "eagle3")}
    assert all(float(x["match_ar"]) == 1.0 for x in t57)
    assert float(next(x for x in t57 if x["batch"] == "2" and x["method"] == "dart")["paper_qwen3-4b_tokens_per_s"]) > 0


@pytest.mark.parametrize("size, kind, repo, weights, model_type", [
    ("4B", "dart", "fvliang/qwen4b-dart", "model.safetensors", "llama"),
    ("1.7B", "dart", "fvliang/qwen1.7b-dart", "model.safetensors", "llama"),
    ("4B", "eagle3", "AngelSlim/Qwen3-4B_eagle3", "model.safetensors", "qwen3"),
    ("1.7B", "eagle3", "AngelSlim/Qwen3-1.7B_eagle3", "pytorch_model.bin", "llama")])
def test_each_hub_head_loads_in_its_released_form(hub_cache, size, kind, repo, weights, model_type):
    """Heads by hub name from the cache: the weights file the released loader reads (EAGLE-3: .bin or
    .safetensors), either model_type, no embed_tokens (the target's is attached), d2t / t2d as written."""
    from safetensors.torch import load_file

    target = loading.load_target(f"Qwen/Qwen3-{size}", device="cpu", dtype="fp32")
    snap = hub_cache / f"models--{repo.replace('/', '--')}" / "snapshots" / fake_hub.COMMIT
    assert (snap / weights).is_file() and json.loads((snap / "config.json").read_text())["model_type"] == model_type
    head = load_head(target, kind, repo, random_heads=False)
    assert isinstance(head, DartHead if kind == "dart" else Eagle3Head)
    written = load_file(str(snap / weights)) if weights.endswith("safetensors") else torch.load(snap / weights, weights_only=True)
    assert "embed_tokens.weight" not in written and head.embed_tokens is target.model.get_input_embeddings()
    sd = head.state_dict()
    assert set(written) == set(sd)
    for k, v in written.items():
        assert torch.equal(sd[k], v.to(sd[k].dtype)), k
    assert head.draft_to_target().tolist() == torch.nonzero(written["t2d"]).flatten().tolist()


def _bad_cli(args: list[str], env: dict, capsys, process: bool = False) -> str:
    """`dart-lab generate ... args` -> its one stderr line; in this process (the CLI's own `main`) or, with
    `process`, as a command (its exit code and no traceback)."""
    argv = ["generate", "--prompt", "hi", "--max-new-tokens", "2", "--dtype", "fp32", "--device", "cpu", *args]
    if process:
        r = subprocess.run([sys.executable, "-m", "dart_lab", *argv], env=env, capture_output=True, text=True, timeout=300)
        code, err = r.returncode, r.stderr
    else:
        from dart_lab import cli

        capsys.readouterr()
        code, err = cli.main(argv), capsys.readouterr().err
    assert code != 0 and "Traceback" not in err, err[-2000:]
    lines = [x for x in err.strip().splitlines() if x.startswith("dart-lab: error")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


@pytest.mark.slow  # a command
def test_a_bad_hub_artifact_is_one_line_naming_it(hub_cache, tmp_path, capsys):
    """A missing weights file, a head whose file lacks weights (wrong layout), a trie cut mid-file (as a command),
    and a repo the offline cache does not hold: each one line on stderr, non-zero exit, no traceback."""
    from safetensors.torch import load_file, save_file

    env = _env(hub_cache, tmp_path)
    target = ["--target", "Qwen/Qwen3-4B"]
    snap = hub_cache / "models--fvliang--qwen4b-dart" / "snapshots" / fake_hub.COMMIT
    missing = tmp_path / "no-weights"
    missing.mkdir()
    (missing / "config.json").write_bytes((snap / "config.json").read_bytes())
    line = _bad_cli([*target, "--method", "dart", "--dart-head", str(missing)], env, capsys)
    assert "no weights" in line and "model.safetensors" in line
    wrong = tmp_path / "wrong-layout"
    wrong.mkdir()
    (wrong / "config.json").write_bytes((snap / "config.json").read_bytes())
    sd = {k: v for k, v in load_file(str(snap / "model.safetensors")).items() if not k.startswith("midlayer.self_attn")}
    save_file(sd, str(wrong / "model.safetensors"))
    line = _bad_cli([*target, "--method", "dart", "--dart-head", str(wrong)], env, capsys)
    assert "lacks 4 weight(s)" in line and "midlayer.self_attn" in line
    trie = (hub_cache / "models--fvliang--dart-qwen3-ngram" / "snapshots" / fake_hub.COMMIT / "full.trie").read_bytes()
    (tmp_path / "cut.trie").write_bytes(trie[: len(trie) // 2 + 3])
    line = _bad_cli([*target, "--method", "dart", "--dart-head", "fvliang/qwen4b-dart", "--ngram", str(tmp_path / "cut.trie")],
                    env, capsys, process=True)
    assert "cut.trie" in line and "truncated" in line
    line = _bad_cli([*target, "--method", "dart", "--dart-head", "fvliang/qwen99b-dart"], env, capsys)
    assert "fvliang/qwen99b-dart" in line and "HF_HUB_OFFLINE" in line and "hf download" in line


def _random_trie(path: Path, seed: int) -> list:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 30, rng.integers(1, 40)).tolist() for _ in range(20)]
    write_trie(path, seqs)
    return seqs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_trie_is_read_in_cpp_as_the_python_loop_reads_it_and_cached(tmp_path, seed, monkeypatch):
    """`ngram.read_trie` (C++ walk, numpy tables) = the counts of the sequences written; the C++ walk = the Python
    loop node for node; a trie cut anywhere is refused on both paths; the second read comes from the cache."""
    if not kernels.trie_here():
        pytest.skip("no C++ compiler here: the Python loop is the only reader")
    path = tmp_path / "t.trie"
    seqs = _random_trie(path, seed)
    with kernels.turned_off("trie"):
        slow = _trie_nodes(path)
    fast = _trie_nodes(path)
    assert all(np.array_equal(a, b) for a, b in zip(fast[:3], slow[:3])) and fast[3] == slow[3] == 3
    ng, ref = read_trie(path, vocab_size=30), NGram.from_sequences(seqs, 30)
    for name in ("uni", "bi", "tri"):
        assert np.array_equal(getattr(ng, name + "_keys"), getattr(ref, name + "_keys"))
        assert np.array_equal(getattr(ng, name + "_counts"), getattr(ref, name + "_counts"))
    data = path.read_bytes()
    for cut in sorted({16, 17, 40, len(data) // 3, len(data) - 12, len(data) - 1}):
        (tmp_path / "cut.trie").write_bytes(data[:cut])
        for off in (False, True):
            with kernels.turned_off(*(["trie"] if off else [])), pytest.raises(DartLabError, match="truncated|trailing"):
                read_trie(tmp_path / "cut.trie", vocab_size=30, cache=False)
    import dart_lab.ngram as ngram_mod
    monkeypatch.setattr(ngram_mod, "_trie_nodes", lambda p: pytest.fail("parsed again: the cache was not used"))
    again = read_trie(path, vocab_size=30)
    assert np.array_equal(again.tri_keys, ng.tri_keys) and np.array_equal(again.tri_counts, ng.tri_counts)


def test_a_trie_of_another_vocabulary_or_shape_is_refused(tmp_path):
    write_trie(tmp_path / "t.trie", [[5, 60, 7]])
    with pytest.raises(DartLabError, match="outside the vocabulary of 50"):
        read_trie(tmp_path / "t.trie", vocab_size=50, cache=False)
    # a node whose parent link points past the nodes
    buf = bytearray((tmp_path / "t.trie").read_bytes())
    struct.pack_into("<Q", buf, 16 + 28 + 12 * 3 + 4, 99)  # node 1's parent
    (tmp_path / "p.trie").write_bytes(bytes(buf))
    with pytest.raises(DartLabError, match="parent"):
        read_trie(tmp_path / "p.trie", vocab_size=100, cache=False)


def test_a_gpu_torch_cannot_use_is_a_loud_warning(monkeypatch):
    """A machine whose driver lists an NVIDIA GPU but whose torch cannot use it gets one warning naming the
    fix, and runs on the CPU; without such a GPU, nothing is said."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(loading, "nvidia_gpu_present", lambda: True)
    with pytest.warns(UserWarning, match="NVIDIA GPU is present but this torch .* cannot use it") as got:
        assert loading.resolve_device("auto").type == "cpu"
    assert len(got) == 1 and "\n" not in str(got[0].message)
    monkeypatch.setattr(loading, "nvidia_gpu_present", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loading.resolve_device("auto")


def test_a_hub_target_is_read_in_the_dtype_it_runs_in(hub_cache, monkeypatch):
    """bf16 straight from the files (no fp32 copy first); on CUDA "auto" reads bf16 and goes to the device in
    from_pretrained (device_map); on a CPU "auto" starts from the exact fp32 weights (`choose_dtype`)."""
    from transformers import AutoModelForCausalLM

    seen = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: seen.append(k) or real(*a, **k))
    t = loading.load_target("Qwen/Qwen3-4B", device="cpu", dtype="bf16")
    assert seen[-1]["dtype"] == torch.bfloat16 and "device_map" not in seen[-1]
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert loading.load_dtype(torch.device("cuda"), "auto") == torch.bfloat16
    assert loading.load_dtype(torch.device("cuda"), "fp32") == torch.float32
    assert loading.load_dtype(torch.device("cpu"), "auto") == torch.float32
    assert loading.load_dtype(torch.device("cpu"), "int4") == torch.float32


def test_a_head_config_with_rope_scaling_is_refused(hub_cache, tmp_path):
    """The heads run plain RoPE; a config asking for scaled positions would draft off-position, so it stops."""
    snap = hub_cache / "models--fvliang--qwen4b-dart" / "snapshots" / fake_hub.COMMIT
    head = tmp_path / "scaled"
    head.mkdir()
    cfg = json.loads((snap / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "linear", "factor": 2.0}}))
    (head / "model.safetensors").write_bytes((snap / "model.safetensors").read_bytes())
    with pytest.raises(DartLabError, match="rope_scaling .* not supported"):
        DartHead.load(head)
    (head / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "default"}}))
    assert DartHead.load(head).cfg.draft_vocab_size == cfg["draft_vocab_size"]
