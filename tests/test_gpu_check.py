"""experiments/engine/gpu_check.py (the prepared device check) runs end to end at toy size on the CPU
(on a GPU box: full size), as a command."""
import json
import subprocess
import sys
from pathlib import Path


def test_gpu_check_script_at_toy_size(tmp_path):
    path = Path(__file__).resolve().parent.parent / "experiments" / "engine" / "gpu_check.py"
    out = tmp_path / "g.json"
    run = subprocess.run([sys.executable, str(path), "--toy", "--device", "cpu", "--dtype", "fp32", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["runner"] == "fast"
    assert set(res["verify_ratio"]) == {"1", "4", "16", "61"} and res["predicted_speedup_theta60"] > 0
    # batches: every row = batch-1 AR on both runners (part of ok), stage costs per batch size
    assert {"batch3-dart-fast", "batch3-pld-hf"} <= set(res["lossless_fp32"]["qwen3"])
    assert set(res["batch"]) == {"1", "2"}
    for row in res["batch"].values():
        assert row["dart"]["nodes_per_row"] > row["ar"]["nodes_per_row"] == 1 and row["predicted_dart_over_base"] > 0
