"""The reproduction path: paper presets' code paths with tiny local stand-ins, and a papermill smoke
run of reproduce/run_all.ipynb followed by reading its stored results."""
import csv
import json
from pathlib import Path

import pytest

from dart_lab import tables as rp
from dart_lab.ngram import write_trie
from dart_lab.presets import PRESETS, Preset, get_preset
from test_drafters import write_official_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def test_presets_are_complete():
    for name, p in PRESETS.items():
        assert p.model and p.datasets
        if name.startswith("paper-"):
            assert p.dart_head.startswith("fvliang/") and p.eagle3_head.startswith("AngelSlim/")
            assert p.ngram == "hub:fvliang/dart-qwen3-ngram/full.trie" and "mt_bench" in p.datasets
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("paper-llama-70b")


def test_paper_preset_path_with_local_stand_ins(embedded, tmp_path):
    """Official-layout DART + EAGLE-3 checkpoints and an official .trie, all local and tiny, through
    the same run_cells/table code the paper presets use, with the paper's tree budget (the automatic
    one's calibration, ~100 s of decoding here on a 2-core AVX2 CPU, is tested in test_budget.py)."""
    H, V = embedded.hidden_size, embedded.vocab_size
    write_official_checkpoint(tmp_path / "dart", H=H, V=V, Vd=64, heads=9, kv=3, inter=256, draft_length=3)
    write_official_checkpoint(tmp_path / "e3", H=H, V=V, Vd=64, heads=9, kv=3, inter=256, eagle=True)
    ids = embedded.tokenizer("The quick brown fox jumps over the lazy dog. " * 5).input_ids
    write_trie(tmp_path / "tiny.trie", [ids])
    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Name a colour."]}) + "\n")
    pre = Preset(name="stand-in", model="smollm2-135m", dart_head=str(tmp_path / "dart"),
                 eagle3_head=str(tmp_path / "e3"), ngram=str(tmp_path / "tiny.trie"),
                 datasets=(f"jsonl:{tmp_path / 'q.jsonl'}",), paper_model="qwen3-4b", dtype="fp32")
    res = rp.run_cells(pre, pre.datasets, ["ar", "dart", "eagle3"], 1, 8, [0.0], tmp_path / "out", target=embedded,
                       progress=False, tree_nodes="paper")
    t1 = rp.table1(res, rp.paper_tables(), pre.paper_model)
    dart = next(r for r in t1 if r["method"] == "dart")
    paper_row = next(r for r in rp.paper_tables()["table1_speedup"]
                     if (r["model"], r["method"], r["temperature"]) == ("qwen3-4b", "dart", 0.0))
    assert dart["match_ar"] == 1.0 and dart["paper_model"] == "qwen3-4b"
    assert dart["paper_mean_tau"] == paper_row["mean_tau"]
    # cached: a second call loads the stored cell instead of recomputing
    again = rp.run_cells(pre, pre.datasets, ["ar", "dart", "eagle3"], 1, 8, [0.0], tmp_path / "out", target=None,
                         progress=False, tree_nodes="paper")
    assert again[0]["per_prompt"] == res[0]["per_prompt"]


def test_papermill_smoke_run_and_its_results(tmp_path):
    papermill = pytest.importorskip("papermill")
    papermill.execute_notebook(str(ROOT / "reproduce" / "run_all.ipynb"), str(tmp_path / "out.ipynb"),
                               parameters={"smoke": True, "results_dir": str(tmp_path / "results")},
                               cwd=str(ROOT / "reproduce"), progress_bar=False, kernel_name="python3")
    out = rp.local_results_dir(tmp_path / "results", "embedded", smoke=True)
    assert out.parent.parent.name == "local"  # this machine's results, outside the stored reference
    rows = list(csv.DictReader(open(out / "table1.csv")))
    assert {r["method"] for r in rows} >= {"dart", "dart-no-ngram"}
    greedy = [r for r in rows if float(r["temperature"]) == 0.0]
    assert greedy
    # lossless in the reproduction too: the smoke run decodes in fp32, so every greedy output equals AR's
    # (the auto dtype's near-tie rule is tested on the embedded target in test_embedded)
    cells = [json.loads(f.read_text()) for f in (out / "bench").glob("*T0.0*.json")]
    assert cells
    for cell in cells:
        assert cell["machine"]["dtype"] == "torch.float32"
        for m, d in cell["methods"].items():
            if m != "ar":
                assert d["divergences"] == 0, (m, d.get("max_divergence_margin"))
    assert all(float(r["speedup"]) > 0 and float(r["tau"]) >= 1.0 for r in rows)
    t2 = list(csv.DictReader(open(out / "table2.csv")))
    assert t2 and t2[0]["dataset"] == "mt_bench"
    assert (out / "figure1.html").stat().st_size > 1000 and "mean speedup" in (out / "summary.md").read_text()
    # Tables 5-7: every method at batch 1 and 2, over batched AR at the same size, the paper's rows beside
    t57 = list(csv.DictReader(open(out / "tables5_7.csv")))
    assert {(int(r["batch"]), r["method"]) for r in t57} == {(b, m) for b in (1, 2) for m in ("ar", "dart", "hf")}
    assert all(float(r["x_base"]) == 1.0 for r in t57 if r["method"] == "ar")
    assert next(r for r in t57 if r["batch"] == "2" and r["method"] == "dart")["paper_qwen3-4b_x_base"]
    assert (out / "figure_batch.html").stat().st_size > 1000


def test_tables_3_and_4_render_stored_training_ablations(tmp_path):
    """Tables 3 and 4 read shift_ablation.json / gamma_sweep.json (written by reproduce/ablations.py)
    and pair each row with the paper's; without the files they hold the paper's rows, ours blank ("not run")."""
    paper = rp.paper_tables()
    alone = rp.table4(tmp_path, paper)
    assert [r["gamma"] for r in alone] == [r["gamma"] for r in paper["table4_gamma"]["rows"]]
    assert all(r["alpha_1_6"] is None and r["paper_alpha_1_6"] for r in alone)
    alone = rp.table3(tmp_path, paper)
    assert {r["variant"] for r in alone} == {"shifted", "unshifted"} and all(r["acc_1_3"] is None for r in alone)
    sweep = {"rows": [{"gamma": 0.6, "alpha": [0.3, 0.2], "acc": [0.3, 0.1], "tau_chain": 1.5},
                      {"gamma": 1.0, "alpha": [0.28, 0.19], "acc": [0.28, 0.09], "tau_chain": 1.45}]}
    (tmp_path / "gamma_sweep.json").write_text(json.dumps(sweep))
    rows = rp.table4(tmp_path, paper)
    ref = {r["gamma"]: r for r in paper["table4_gamma"]["rows"]}
    assert [r["gamma"] for r in rows] == [0.6, 1.0] and rows[1]["acc_1_6"] == [0.28, 0.09]
    assert rows[0]["paper_tau"] == ref[0.6]["tau"] and rows[1]["paper_alpha_1_6"] == ref[1.0]["alpha"]
    rp.write_table(rows, tmp_path / "table4")
    assert "0.600" in (tmp_path / "table4.md").read_text()
    shift = {"rows": [{"variant": v, "acc": [a, 0.1, 0.05], "hit10": [0.7, 0.4, 0.3], "tau_chain": 1.4}
                      for v, a in (("shifted", 0.35), ("unshifted", 0.25))]}
    (tmp_path / "shift_ablation.json").write_text(json.dumps(shift))
    t3 = rp.table3(tmp_path, paper)
    assert [r["variant"] for r in t3] == ["shifted", "unshifted"] and t3[1]["acc_1_3"][0] == 0.25
    assert t3[0]["paper_alpha_1_3"] == paper["table3_shifted_logits"]["shifted"]["alpha"]
    assert rp.ablation_noise(tmp_path) == ""  # no seeds recorded: no noise line
    sweep["noise"] = {"rows": [{"seed": 0, "acc": [0.30], "tau_chain": 1.50}, {"seed": 1, "acc": [0.32], "tau_chain": 1.47}],
                      "spread": {"acc_1": 0.02, "tau_chain": 0.03}}
    (tmp_path / "gamma_sweep.json").write_text(json.dumps(sweep))
    assert "spread acc-1 0.020, chain tau 0.030" in rp.ablation_noise(tmp_path)
