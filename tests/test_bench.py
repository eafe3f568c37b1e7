"""Bench: JSON schema, resume after interruption, bad input."""
import dataclasses
import json
import random
import subprocess
import sys

import pytest

from dart_lab import DartLabError
from dart_lab.bench import BenchConfig, fastest_pass, ratio_interval, run_bench
from dart_lab.data import load_prompts
from dart_lab.methods import MethodOptions, Runner, make_runner

OPTS = MethodOptions(random_heads=True, ngram_max_tokens=100_000, tree_nodes=16)


def test_bench_json_schema_and_resume(embedded, tmp_path, monkeypatch):
    cfg = BenchConfig(methods=("ar", "dart", "hf"), dataset="mt_bench", num_prompts=2, max_new_tokens=12,
                      warmup=1, model="smollm2-135m", device="cpu", dtype="fp32", options=OPTS)
    out = tmp_path / "b.json"
    real = Runner.generate
    calls = {"n": 0}

    def flaky(self, *a, **k):  # interrupt during the second prompt (after warm-up: 3 calls)
        calls["n"] += 1
        if calls["n"] > 3 + 3 + 1:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(Runner, "generate", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_bench(cfg, out, target=embedded, progress=False)
    partial = out.with_name(out.name + ".partial.jsonl")
    first = [json.loads(line)["row"] for line in partial.read_text().splitlines()]
    assert {r["method"] for r in first} == {"ar", "dart", "hf"} and not out.exists()
    monkeypatch.setattr(Runner, "generate", real)
    res = run_bench(cfg, out, target=embedded, progress=False)
    assert out.exists() and not partial.exists()
    saved = json.loads(out.read_text())
    assert saved["config"]["methods"] == ["ar", "dart", "hf"]
    assert {"platform", "torch", "transformers", "device", "dtype"} <= set(saved["machine"])
    load = saved["machine_load"]  # how busy the machine was with other work, and the verdict
    assert {"others_cores", "own_cpu_s", "wall_s", "contended"} <= set(load) and load["own_cpu_s"] > 0
    for m in ("ar", "dart", "hf"):
        d = saved["methods"][m]
        for k in ("tokens_per_s", "tau", "speedup_vs_ar", "draft_ms", "search_ms", "verify_ms", "match_ar",
                  "n_prompts", "new_tokens"):
            assert k in d, (m, k)
        assert d["match_ar"] == 1.0 and d["n_prompts"] == 2
    assert saved["methods"]["ar"]["tau"] == 1.0 and saved["methods"]["hf"]["tau"] is None
    # the first prompt's rows were reused, not recomputed
    p0 = load_prompts("mt_bench", 1)[0]["id"]
    reused = [r for r in saved["per_prompt"] if r["prompt_id"] == p0]
    assert sorted(json.dumps(r, sort_keys=True) for r in reused) == sorted(json.dumps(r, sort_keys=True) for r in first)
    assert res["methods"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)


def test_bench_repeats_count_the_fastest_pass(embedded, tmp_path):
    cfg = BenchConfig(methods=("ar", "dart"), dataset="mt_bench", num_prompts=2, max_new_tokens=8, warmup=0,
                      repeats=2, model="smollm2-135m", device="cpu", dtype="fp32", options=OPTS)
    res = run_bench(cfg, tmp_path / "r.json", target=embedded, progress=False)
    rows = res["per_prompt"]
    assert sorted((r["prompt_id"], r["method"], r["repeat"]) for r in rows) == sorted(
        (p, m, k) for p in {r["prompt_id"] for r in rows} for m in ("ar", "dart") for k in (0, 1))
    for m in ("ar", "dart"):
        best = sum(min(r["total_s"] for r in rows if r["method"] == m and r["prompt_id"] == p)
                   for p in {r["prompt_id"] for r in rows})
        first = sum(r["total_s"] for r in rows if r["method"] == m and r["repeat"] == 0)
        assert res["methods"][m]["total_s"] == pytest.approx(best)
        assert res["methods_first_pass"][m]["total_s"] == pytest.approx(first)
        assert res["methods"][m]["match_ar"] == 1.0  # greedy passes emit the same tokens
    with pytest.raises(DartLabError, match="repeats > 1 needs temperature 0"):
        BenchConfig(repeats=2, temperature=1.0)
    with pytest.raises(DartLabError, match="repeats must be >= 1"):
        BenchConfig(repeats=0)


def test_ratio_interval_resamples_prompts_paired():
    """The bootstrap interval of a speedup ratio: exact when every prompt has the same ratio, around the
    point estimate otherwise, narrower with more prompts, counting each (prompt, method) by its fastest pass."""
    def rows(n, noise, seed=0):
        g = random.Random(seed)
        out = []
        for i in range(n):
            base = g.uniform(1.0, 3.0)
            for m, t in (("a", base / 1.25 * (1 + noise * g.uniform(-1, 1))), ("b", base), ("c", base * 1.1)):
                for rep, slow in ((0, 1), (1, 9 if m == "a" else 1)):  # a's second pass is slow
                    out.append({"prompt_id": f"p{i}", "method": m, "new_tokens": 100, "total_s": t * slow, "repeat": rep})
        return out
    lo, hi = ratio_interval(rows(12, 0.0), "a", ["b", "c"])  # c is slower: the faster of b, c is b
    assert lo == pytest.approx(1.25) and hi == pytest.approx(1.25)  # the slow second passes do not count
    noisy = rows(12, 0.3)
    best = fastest_pass(noisy)
    speed = {m: sum(r["new_tokens"] for r in best if r["method"] == m)
             / sum(r["total_s"] for r in best if r["method"] == m) for m in "ab"}
    lo, hi = ratio_interval(noisy, "a", ["b"])
    assert lo < speed["a"] / speed["b"] < hi and hi - lo > 0.05
    lo_many, hi_many = ratio_interval(rows(200, 0.3, seed=1), "a", ["b"])
    assert hi_many - lo_many < (hi - lo) / 2
    assert ratio_interval(rows(1, 0.3), "a", ["b"]) is None


def test_datasets_load():
    for name in ("mt_bench", "humaneval"):
        rows = load_prompts(name, 3)
        assert len(rows) == 3 and all(r["prompt"].strip() for r in rows)


def test_shared_datasets_load():
    from dart_lab.assets import data_dir

    if data_dir(required=False) is None:
        pytest.skip("shared data folder (DART_LAB_DATA or ../shared/data) is absent")
    for name in ("gsm8k", "code_alpaca", "alpaca"):
        assert len(load_prompts(name, 5)) == 5


def test_jsonl_formats(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question_id": 1, "category": "x", "turns": ["first", "second"]}\n{"prompt": "plain"}\n')
    rows = load_prompts(f"jsonl:{p}")
    assert [r["prompt"] for r in rows] == ["first", "plain"]
    p.write_text('{"nothing": 1}\n')
    with pytest.raises(DartLabError, match="row 1"):
        load_prompts(f"jsonl:{p}")


@pytest.mark.slow  # runs the CLI as commands
def test_bad_bench_input(tmp_path):
    with pytest.raises(DartLabError, match="unknown dataset"):
        load_prompts("imagenet")
    with pytest.raises(DartLabError, match="unknown method"):
        BenchConfig(methods=("ar", "medusa"))
    with pytest.raises(DartLabError, match="jsonl dataset not found"):
        load_prompts(f"jsonl:{tmp_path}/missing.jsonl")
    r = subprocess.run([sys.executable, "-m", "dart_lab", "bench", "--methods", "ar,nope", "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "unknown method 'nope'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "dart_lab", "bench", "--dataset", "nope", "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "unknown dataset 'nope'" in r.stderr


def test_bench_batch_sizes_keep_methods_and_add_by_batch(embedded, tmp_path):
    """--batch-size 1,2: `methods` is batch 1's block as before; by_batch has both sizes with the same
    per-method fields; every batched row equals batched AR's (fp32); a bad size is refused in one line."""
    cfg = BenchConfig(methods=("ar", "dart", "hf"), dataset="humaneval", num_prompts=3, max_new_tokens=10, warmup=1,
                      model="smollm2-135m", device="cpu", dtype="fp32", options=OPTS, batch_sizes=(1, 2))
    res = run_bench(cfg, tmp_path / "b.json", target=embedded, progress=False)
    assert set(res["by_batch"]) == {"1", "2"} and res["methods"] == res["by_batch"]["1"]["methods"]
    for B in ("1", "2"):
        for m in ("ar", "dart", "hf"):
            assert set(res["by_batch"]["1"]["methods"][m]) == set(res["by_batch"][B]["methods"][m]), (B, m)
        assert res["by_batch"][B]["methods"]["dart"]["match_ar"] == 1.0
    batched = [r for r in res["per_prompt"] if r.get("batch_size")]
    # 3 prompts: groups of 2 and 1, both counted in the batch-2 run
    assert sorted(r["rows_at_once"] for r in batched if r["method"] == "ar") == [1, 2]
    assert {r["batch_size"] for r in batched} == {2}
    assert all(len(r["match_ar_rows"]) == r["rows_at_once"] and all(r["match_ar_rows"]) for r in batched
               if r["method"] == "dart")
    # the sizes interleaved, each unit in the order of its first prompt (drift on the machine moves both alike)
    assert [r.get("batch_size", 1) for r in res["per_prompt"] if r["method"] == "ar"] == [1, 2, 1, 1, 2]
    # continuous batching: 2 rows at once over all 3 prompts, one decode per method
    cont = run_bench(dataclasses.replace(cfg, methods=("ar", "dart"), batch_sizes=(2,), continuous=True),
                     tmp_path / "c.json", target=embedded, progress=False)
    rows = [r for r in cont["per_prompt"] if r["method"] == "dart"]
    assert len(rows) == 1 and rows[0]["rows_at_once"] == 2 and rows[0]["match_ar_rows"] == [True] * 3
    assert "continuous batching" in cont["aggregation"]
    with pytest.raises(DartLabError, match="batch sizes"):
        BenchConfig(batch_sizes=(0,))
    assert BenchConfig().key() == BenchConfig(batch_sizes=(1,)).key() != BenchConfig(batch_sizes=(1, 2)).key()


def test_bench_skips_an_outside_engine_that_is_not_installed(embedded, tmp_path, monkeypatch):
    """The optional llamacpp method: without llama-cpp-python the bench runs the other methods and says
    why it left it out (in the JSON's `skipped`), never fails; nor does a build that would crash it."""
    import sys
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    cfg = BenchConfig(methods=("ar", "llamacpp"), dataset="mt_bench", num_prompts=1, max_new_tokens=4, warmup=0,
                      model="smollm2-135m", device="cpu", dtype="fp32", options=OPTS)
    res = run_bench(cfg, tmp_path / "b.json", target=embedded, progress=False)
    assert set(res["methods"]) == {"ar"} and "llama-cpp-python" in res["skipped"]["llamacpp"]
    with pytest.raises(DartLabError, match="llama-cpp-python"):
        make_runner("llamacpp", embedded)
    # a build whose AMX matmul would kill the process at its first forward is skipped the same way
    import types
    from dart_lab.llamacpp import unavailable_reason
    amx = types.SimpleNamespace(llama_print_system_info=lambda: b"CPU : AVX512 = 1 | AMX_INT8 = 1 | ")
    monkeypatch.setitem(sys.modules, "llama_cpp", amx)
    res = run_bench(cfg, tmp_path / "c.json", target=embedded, progress=False)
    assert set(res["methods"]) == {"ar"} and "AMX" in res["skipped"]["llamacpp"]
    amx.llama_print_system_info = lambda: b"CPU : AVX512 = 1 | "
    assert unavailable_reason(embedded) is None


def test_the_outside_engine_prefills_every_prompt_from_scratch(embedded, monkeypatch):
    """llama-cpp-python keeps the KV of the prefix a prompt shares with the previous call (even with
    `reset=True`), so a repeated prompt, or one sharing the chat template's opening, would skip prefill
    work our runners do: the anchor forgets it before each prompt. A stand-in `Llama` with that reuse counts
    the prompt tokens each call evaluates."""
    import sys
    import types
    from dart_lab.config import GenerationConfig
    from dart_lab.llamacpp import LlamaCpp

    class PrefixKeepingLlama:
        def __init__(self, model_path, **kw):
            self.n_tokens, self.input_ids, self.evaluated = 0, [], []

        def n_vocab(self):
            return embedded.vocab_size

        def reset(self):
            self.n_tokens = 0

        def generate(self, tokens, reset=True, **kw):
            keep = 0
            if self.n_tokens:
                for a, b in zip(self.input_ids, tokens):
                    if a != b:
                        break
                    keep += 1
            self.evaluated.append(len(tokens) - keep)
            self.input_ids, self.n_tokens = list(tokens), len(tokens)
            while True:
                yield 7

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=PrefixKeepingLlama,
                                                                        llama_print_system_info=lambda: b""))
    lc = LlamaCpp(embedded)
    prompt = embedded.encode_prompt("Write a function that adds two numbers.")
    other = embedded.encode_prompt("Write a function that reverses a list.")
    cfg = GenerationConfig(max_new_tokens=3, stop_on_eos=False)
    for p in (prompt, prompt, other):
        assert len(lc.generate(p, cfg).tokens) == 3
    assert lc.llm.evaluated == [len(prompt), len(prompt), len(other)]


def test_memory_probe_reads_its_whole_buffer():
    """The bandwidth probe's buffer holds the bytes asked for (ones, on a CPU mapped with 2 MB pages where the OS
    grants them), and the probe gives a finite reading; the mapping is released after it."""
    import math

    import torch

    from dart_lab.machine import _probe_buffer, memory_read_gbs

    buf, held = _probe_buffer(1 << 20, torch.device("cpu"))
    assert buf.shape == (1 << 20,) and buf.dtype == torch.float32 and float(buf.sum()) == float(1 << 20)
    del buf, held
    gbs = memory_read_gbs(mbytes=8, repeats=2)
    assert math.isfinite(gbs) and gbs > 0
