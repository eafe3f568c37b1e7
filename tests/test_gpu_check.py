"""reproduce/gpu_check.py runs end to end at toy size on the CPU (on a GPU box: full size)."""
import importlib.util
import json
from pathlib import Path


def test_gpu_check_script_at_toy_size(tmp_path, capsys):
    path = Path(__file__).resolve().parent.parent / "reproduce" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--toy", "--device", "cpu", "--dtype", "fp32", "--out", str(tmp_path / "g.json")]) == 0
    res = json.loads((tmp_path / "g.json").read_text())
    assert res["ok"] and res["runner"] == "fast"
    assert set(res["verify_ratio"]) == {"1", "4", "16", "61"} and res["predicted_speedup_theta60"] > 0
