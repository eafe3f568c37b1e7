"""A C++ kernel of `dart_lab/csrc/` as it was at a git revision, built under its own op namespace beside the
working tree's (for the `*_rev_ab.py` timings): `ops_at("q4mm", "HEAD~1").q4mm`."""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[2]


def ops_at(stem: str, rev: str):
    """torch.ops.<stem>_rev: `csrc/<stem>.cpp` at `rev`, its ops renamed out of the `dart_lab` namespace."""
    src = subprocess.run(["git", "show", f"{rev}:dart_lab/csrc/{stem}.cpp"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    ns = f"{stem}_rev"
    src = src.replace("TORCH_LIBRARY_FRAGMENT(dart_lab", f"TORCH_LIBRARY_FRAGMENT({ns}") \
             .replace("TORCH_LIBRARY_IMPL(dart_lab", f"TORCH_LIBRARY_IMPL({ns}")
    folder = Path(tempfile.mkdtemp())
    (folder / f"{ns}.cpp").write_text(src)
    load(name=ns, sources=[str(folder / f"{ns}.cpp")], extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False)
    return getattr(torch.ops, ns)
