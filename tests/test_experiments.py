"""Every script in experiments/ runs in its smallest mode (`--smoke` on tiny random models, `--toy` for the device
check, the stored run for the engine table), in process through its `main(argv)`, and answers with what its
question needs: the keys, finite positive timings, and the invariants of its numbers. Also the device check's
lossless comparisons (gpu_check.py --toy) and the oracle's pieces against brute force (copy_head_oracle.py
--self-check). One thread (the smallest modes time tiny ops, which two threads on a shared 2-core machine only
slow down) and a fresh measurement cache for the module."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"


def run(script: str, argv: list[str]):
    """Import experiments/<script> by path (a fresh module each time) and call its main(argv)."""
    path = EXPERIMENTS / script
    spec = importlib.util.spec_from_file_location(f"experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.fixture(scope="module", autouse=True)
def one_thread_fresh_cache(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("DART_LAB_CACHE", str(tmp_path_factory.mktemp("dart_lab_cache")))
    yield
    mp.undo()
    torch.set_num_threads(threads)


def positive(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


def check_verify_latency(res, tmp_path):
    assert set(res) == {"fp32@16", "fp32@64", "bf16@16", "bf16@64"}
    for curve in res.values():
        assert list(curve) == [1, 2, 4, 8] and positive(*curve.values())


def check_gpu_check(res, tmp_path):
    assert json.loads((tmp_path / "g.json").read_text()) == res  # what --out wrote
    assert res["ok"] and res["runner"] == "fast"
    assert set(res["verify_ratio"]) == {"1", "4", "16", "61"} and res["predicted_speedup_theta60"] > 0
    # every method = AR token for token, both models; batches: every row = batch-1 AR on both runners
    for same in res["lossless_fp32"].values():
        assert all(same.values()) and {"ar-fast", "dart", "eagle3", "pld"} <= set(same)
    assert {"batch3-dart-fast", "batch3-pld-hf"} <= set(res["lossless_fp32"]["qwen3"])
    assert set(res["batch"]) == {"1", "2"}
    for row in res["batch"].values():
        assert row["dart"]["nodes_per_row"] > row["ar"]["nodes_per_row"] == 1 and row["predicted_dart_over_base"] > 0
    assert positive(res["draft_ms"], res["search_ms"]) and res["predicted_best"]["theta"] >= 0
    assert res["sections_done"] == ["a lossless", "b bandwidth", "c step", "d end to end", "e batches"]
    assert positive(res["bandwidth"]["copy_gbs"], res["bandwidth"]["read_gbs"]) and res["host"]["torch"]
    step = res["step"]["shapes"]["toy"]
    assert set(step["eager"]) == {"32", "64"} and positive(step["floor_ms"], *step["eager"].values())
    e2e = res["end_to_end"]["eager"]  # the oracle accepts AR's continuation: the same tokens, tau near the paper's
    assert e2e["same_tokens"] and 2.0 <= e2e["tau"] <= res["paper_tau"] + 1 and positive(e2e["dart_over_ar"])
    for row in res["batch"].values():
        assert row["dart-oracle"]["nodes_per_row"] > 1 and positive(row["oracle_over_ar_measured"]) and row["theta"] >= 0


def check_tree_builders(res, tmp_path):
    from dart_lab.builders import BUILDERS

    assert set(res) == {"T0", "T1"}
    for temp, by_ds in res.items():
        for by_b in by_ds.values():
            assert set(by_b) == set(BUILDERS)
            for r in by_b.values():
                taus = list(r["tau"].values())
                assert taus == sorted(taus) and taus[0] >= 1.0 and r["steps"] > 0  # more nodes never accept less
                assert temp == "T1" or r["match_ar"]  # fp32: every builder's decode is AR's


def check_microbench_search(res, tmp_path):
    assert res["calls"] == 20 and res["config"]["max_nodes"] == 60
    assert positive(res["median_ms"]) and res["p90_ms"] >= res["median_ms"]
    assert 1 < res["mean_tree_nodes"] <= 61  # the root and at most max_nodes drafted
    assert set(res["rows"]) == {f"{n} nodes, {r} rows" for n in (60, 8) for r in (1, 4)}
    for row in res["rows"].values():
        assert positive(row["per_row"], row["batched"], row["on_device"]) and row["same_trees"]


def check_draft_cost_by_theta(res, tmp_path):
    assert set(res) == {"dart", "eagle3"}
    for rows in res.values():
        assert set(rows) == {1, 4}
        for row in rows.values():
            assert positive(row["draft_ms"], row["verify_ms"]) and row["search_ms"] >= 0
    assert all(positive(row["search_ms"]) for row in res["dart"].values())  # DART searches; EAGLE-3 expands


def check_trie_read(res, tmp_path):
    assert [r["mode"] for r in res] == ["cpp", "cache-write", "cache-read", "cpp", "python"]
    counts = [{k: r[k] for k in ("unigrams", "bigrams", "trigrams")} for r in res]
    assert counts[0] == counts[1] == counts[2] and counts[3] == counts[4]  # every reading the same tables
    assert res[0]["nodes"] == 1 + 20 + 200 + 1000 and counts[0]["trigrams"] <= 1000
    assert all(positive(r["s"], r["peak_rss_gb"]) for r in res)


def check_step_profile(res, tmp_path):
    assert positive(res["step_ms"])
    assert 0 < len(res["ops"]) <= 8 and positive(sum(res["ops"].values()))


def check_engine_table(res, tmp_path):
    assert set(res) == {"T0", "T1"}
    rows = [ln for lines in res.values() for text in lines for ln in text.splitlines() if ln.startswith("|")]
    stored = (ROOT / "reproduce/results/2026-12-02_epyc-2c_engine-context-priced/TABLE.md").read_text().splitlines()
    assert rows == [ln for ln in stored if ln.startswith("|")]  # the stored run's tables, as written then


def check_compile_bench(res, tmp_path):
    assert res["shapes_compiled"] == [(1, None)] and res["compile_seconds_total"] > 0
    step = res["steps"]["context 30, 1 nodes"]
    assert positive(step["eager_ms"], step["compiled_ms"])
    assert positive(res["end_to_end"]["ar"]["eager_tokens_per_s"], res["end_to_end"]["ar"]["compiled_tokens_per_s"])


def check_batch_steps(res, tmp_path):
    assert set(res) == {"ar", "dart", "dart-ctx"}
    for m, r in res.items():
        assert positive(r["tokens_per_s"]) and r["shapes"]
        for shape in r["shapes"].values():
            assert positive(shape["verify_ms"], shape["tokens_per_step"], shape["tokens_per_ms"])
    assert {s.split(" x ")[1] for s in res["ar"]["shapes"]} == {"1"}  # AR: one-token steps
    assert any(int(s.split(" x ")[1]) > 1 for s in res["dart"]["shapes"])  # DART: trees (theta 4)


def check_q4_kernel(res, tmp_path):
    if not res:
        pytest.skip("our 4-bit kernel is not built here")
    assert set(res) == {"the layers' linears", "LM head (Q8_0)"}
    for part in res.values():
        assert {"torch int4", "ours"} <= set(part["max_error"])
        assert all(math.isfinite(e) and e < 0.1 for e in part["max_error"].values())
        assert set(part["ms"]) == {1, 4} and all(positive(*ms.values()) for ms in part["ms"].values())
    steps = run("engine/q4_kernel.py", ["--smoke", "--steps"])["one_token_step_ms"]
    assert set(steps) == {"4bit", "measured"} and positive(*steps.values())


def check_attention_ab(res, tmp_path):
    if not res:
        pytest.skip("our attention kernel is not built here")
    assert set(res["alone"]) == {"1 x 1, 40", "1 x 4, 40", "2 x 1, 60"}
    for r in res["alone"].values():
        assert positive(r["sdpa_ms"], r["ours_ms"]) and r["max_abs_diff"] < 1e-4  # the same attention
    assert set(res["steps"]) == {"one token", "4-node chain", "2 rows x one token"}
    assert all(positive(r["sdpa_ms"], r["ours_ms"]) for r in res["steps"].values())


def check_copy_head_oracle(res, tmp_path):
    assert run("dart_ctx/copy_head_oracle.py", ["--self-check"]) == {"self_check": "passed"}
    r = res["datasets"]["random"]
    assert r["prompts"] == 2 and r["positions"] > 0 and positive(r["head_ms"], *r["search_ms"].values())
    s = r["speed_vs_ar_decode_only"]
    assert positive(*s.values())
    # the oracle mixes AR, copy-only and every tree step with hindsight: no online rule over those beats it
    for name in ("copy-only", "tree 2", "tree 4", "dart-ctx rule (theta 4)",
                 "dart-ctx rule (theta 4), p corrected by the head", "hindsight: copy or AR",
                 "hindsight: copy or tree 4"):
        assert s["oracle"] >= s[name] - 2e-3, name
    assert s["oracle, exact copies"] >= s["oracle"] - 2e-3 and s["hindsight: copy or AR"] >= 1 - 2e-3


def check_copy_headroom(res, tmp_path):
    tau = res["tau"]["random"]
    assert set(tau) == {"copy", "copy + 1 alt", "copy + 2 alt", "head oracle", "branch oracle"}
    assert all(1 <= t <= 24 for t in tau.values())  # 1 token a step at least, at most the whole answer


def check_vocab_coverage(res, tmp_path):
    assert res["train_conversations"] == 8
    share = res["outside_share"]["random"]
    assert share["tokens"] == 3 * 16
    ks = [share[k] for k in ("16", "32", "64", "128")]
    assert all(0 <= x <= 1 for x in ks) and ks == sorted(ks, reverse=True)  # a larger vocabulary drafts more


SCRIPTS = [
    ("engine/verify_latency.py", ["--smoke", "--dtypes", "fp32,bf16", "--contexts", "16,64"], check_verify_latency),
    ("engine/gpu_check.py", ["--toy", "--device", "cpu", "--dtype", "fp32", "--out", "{tmp}/g.json"], check_gpu_check),
    ("engine/microbench_search.py", ["--smoke"], check_microbench_search),
    ("engine/tree_builders.py", ["--smoke"], check_tree_builders),
    ("engine/draft_cost_by_theta.py", ["--smoke", "dart", "eagle3"], check_draft_cost_by_theta),
    ("engine/trie_read.py", ["--smoke"], check_trie_read),
    ("engine/step_profile.py", ["--smoke", "--rows", "8"], check_step_profile),
    ("engine/engine_table.py", ["--smoke"], check_engine_table),
    pytest.param("engine/compile_bench.py", ["--smoke", "--out", ""], check_compile_bench,
                 marks=pytest.mark.slow),  # compiling one shape of even a tiny model takes 10-40 s here
    ("engine/batch_steps.py", ["--smoke"], check_batch_steps),
    ("engine/q4_kernel.py", ["--smoke"], check_q4_kernel),
    ("engine/attention_ab.py", ["--smoke"], check_attention_ab),
    ("dart_ctx/copy_head_oracle.py", ["--smoke"], check_copy_head_oracle),
    ("dart_ctx/copy_headroom.py", ["--smoke"], check_copy_headroom),
    ("heads/vocab_coverage.py", ["--smoke"], check_vocab_coverage),
]


def test_every_script_is_tested():
    scripts = {str(p.relative_to(EXPERIMENTS)) for p in EXPERIMENTS.glob("*/*.py")}
    tested = {s.values[0] if hasattr(s, "values") else s[0] for s in SCRIPTS}
    assert scripts == tested and not list(EXPERIMENTS.glob("*/*.sh"))


@pytest.mark.parametrize("script, argv, check", SCRIPTS, ids=[
    (s.values[0] if hasattr(s, "values") else s[0]).split("/")[1][:-3] for s in SCRIPTS])
def test_script_in_its_smallest_mode(script, argv, check, tmp_path):
    res = run(script, [a.replace("{tmp}", str(tmp_path)) for a in argv])
    check(res, tmp_path)
