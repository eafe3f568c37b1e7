"""Our C++ kernels (`dart_lab/csrc/*.cpp`, ops in the `dart_lab` namespace): each built with torch's C++
extension loader the first time a process asks for it (a C++ compiler needed, as for `torch.compile` on a
CPU; ~10-25 s, then cached by torch, one build per torch version), and only on a CPU that has the
instruction sets it is written for. Users: `q4.py` (a 4-bit weight-only matmul), `attention.py` (a
decoding step's attention), `step._rms_norm` (`rms_norm_here`: an eager step's norms),
`step.decoder_step` (`rope_cache_here`: an eager step's rotation and K/V cache write; `layers_here`:
its decoder layers in one op), `generate.top2` (`top2_here`: a step's argmax and margins), `batch_target.BatchTarget.commit`
(`move_slots_here`: its cache compaction), `search._levels` (`search_here`: the tree search's level loop), `ngram.read_trie` (`trie_here`: reading the
released trie)."""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")


# the instruction sets the eager-step kernels are written for (x86-64-v3); each is built for AVX-512 too, and
# picks that build at run time where the CPU has it (csrc/vec.h)
EAGER_ISA = {"avx2", "fma", "f16c"}

# a process on a CPU with AVX-512 that runs as an AVX2-only CPU would: our kernels' AVX2 builds and the 4-bit
# kernel's int16 path (DART_LAB_ISA), torch's own CPU kernels (ATEN_CPU_CAPABILITY), oneDNN's and MKL's. Give it a
# fresh TORCHINDUCTOR_CACHE_DIR too: inductor's cache keys do not tell the two apart, and a graph compiled for
# AVX-512 served to such a process gives NaN logits.
AVX2_ENV = {"DART_LAB_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags (/proc/cpuinfo), empty where they cannot be read. With DART_LAB_ISA=avx2
    in the environment, without AVX-512 and AMX: the kernels then run their AVX2 builds (csrc/vec.h reads the same
    variable), as on a CPU without them -- tests and A/B timings of that path on a CPU that has both."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            if os.environ.get("DART_LAB_ISA") == "avx2":
                flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
            return flags
    return set()


def isa() -> str:
    """Which build of the eager-step kernels runs here: "avx512", "avx2" (csrc/vec.h), or "none" (a CPU without
    AVX2 + FMA + F16C, or one whose flags cannot be read)."""
    flags = cpu_flags()
    return "avx512" if "avx512f" in flags else "avx2" if EAGER_ISA <= flags else "none"


def build(stem: str, need: set[str]) -> str | None:
    """Load (building if needed) `csrc/<stem>.cpp`; None when its ops are usable, else why not."""
    source, flags = CSRC / f"{stem}.cpp", cpu_flags() if need else set()
    if need and not flags:  # plain C++ (no instruction set asked for) builds on any CPU
        return "this CPU's instruction sets cannot be read (no /proc/cpuinfo)"
    missing = need - flags
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for is inline and splits work over OpenMP threads only when built with it
        # one build per torch version (an extension built against another torch's headers may not load)
        name = f"dart_lab_{stem}_" + "".join(c if c.isalnum() else "_" for c in torch.__version__)
        # torch's loader rebuilds when a source or a flag changes, not a header: the headers' digest as a flag
        digest = hashlib.sha256(b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))).hexdigest()[:16]
        load(name, [str(source)], extra_cflags=["-O3", "-fopenmp", f"-DDART_LAB_HEADERS_{digest}"],
             extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, a failed build: the kernel is simply not offered
        return f"building {source.name} failed: {(str(e).strip().splitlines() or [type(e).__name__])[-1][:200]}"
    return None


def reason(state: dict, stem: str, need: set[str], register_fake) -> str | None:
    """Why the kernel of `csrc/<stem>.cpp` is not usable here (None when it is), kept in `state["reason"]`:
    built on the first call, its ops' shapes then registered for torch.compile (`register_fake()`)."""
    if "reason" not in state:
        why = build(stem, need)
        if why is None:
            register_fake()
        state["reason"] = why
    return state["reason"]


def _built(state: dict, stem: str) -> bool:
    """Whether an eager-step kernel (`csrc/<stem>.cpp`, `EAGER_ISA`) is built here; after the first call one dict
    lookup, so a step may ask for each of its ops."""
    if "reason" not in state:
        reason(state, stem, EAGER_ISA, lambda: None)
    return state["reason"] is None


_norm: dict = {}
_rope: dict = {}
_layers: dict = {}
_search: dict = {}
_trie: dict = {}


def rms_norm_here() -> bool:
    """`dart_lab::rms_norm` (csrc/norm.cpp: F.rms_norm's arithmetic in one pass a row, fp32), and the MLP's
    `silu_mul` ops beside it. Eager steps only: a compiled graph keeps F.rms_norm, which inductor fuses."""
    return _built(_norm, "norm")


def rope_cache_here() -> bool:
    """`dart_lab::rope_cache` (csrc/rope.cpp: a step's rotary embedding and K/V cache write in one op, fp32).
    Eager steps only: a compiled graph keeps the torch ops, which inductor fuses."""
    return _built(_rope, "rope")


def top2_here() -> bool:
    """`dart_lab::top2` (csrc/norm.cpp: each row's argmax and top-2 margin in one pass over the logits)."""
    return _built(_norm, "norm")


def move_slots_here() -> bool:
    """`dart_lab::move_slots` (csrc/rope.cpp: a batch step's cache compaction as plain copies)."""
    return _built(_rope, "rope")


def search_here() -> bool:
    """`dart_lab::beam_candidates` (csrc/search.cpp: the tree search's level loop with its n-gram lookups; plain C++,
    any CPU with a compiler)."""
    return reason(_search, "search", set(), lambda: None) is None


def trie_here() -> bool:
    """`dart_lab::trie_nodes` (csrc/trie.cpp: one pass over a released n-gram trie file; plain C++, any CPU with
    a compiler)."""
    return reason(_trie, "trie", set(), lambda: None) is None


def layers_here() -> bool:
    """`dart_lab::q4_layers` (csrc/layers.cpp: an eager step's decoder layers in one op, calling our other
    kernels from C++); it needs those kernels' ops loaded first (`step.decoder_step` asks after them)."""
    return _built(_layers, "layers")


@contextlib.contextmanager
def turned_off(*stems: str):
    """Within: the kernels of these `csrc/<stem>.cpp` ("norm", "rope", "layers", "search", "trie") count as absent, so
    steps take the torch ops (or the Python loop) they replace -- the other side of an A/B timing or a test."""
    states = {"norm": _norm, "rope": _rope, "layers": _layers, "search": _search, "trie": _trie}
    saved = {s: states[s].get("reason", ...) for s in stems}
    try:
        for s in stems:
            states[s]["reason"] = "turned off"
        yield
    finally:
        for s, why in saved.items():
            if why is ...:
                states[s].pop("reason", None)
            else:
                states[s]["reason"] = why
