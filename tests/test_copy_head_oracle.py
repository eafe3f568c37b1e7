"""experiments/dart_ctx/copy_head_oracle.py: its greedy acceptance and its hindsight dynamic program hold
against brute force (the script's own --self-check, run as a command)."""
import subprocess
import sys
from pathlib import Path


def test_copy_head_oracle_self_check():
    path = Path(__file__).resolve().parent.parent / "experiments" / "dart_ctx" / "copy_head_oracle.py"
    run = subprocess.run([sys.executable, str(path), "--self-check"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "self-check passed" in run.stdout, run.stderr[-2000:]
