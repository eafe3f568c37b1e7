"""An outside anchor: llama.cpp (through llama-cpp-python) decoding the embedded target's own GGUF.

The `llamacpp` method of the bench: plain greedy decoding by a C++ engine on the same weights (the GGUF's
Q4_1 layers, read at ~4.5 bits), the same prompt ids (our tokenizer's chat template), the same threads and
the same token counting, so its tokens/s stand beside ours. Optional: llama-cpp-python is built from source
on most machines and `make test` does not need it; where it is absent the bench skips the method and says why.
"""
from __future__ import annotations

import time
from dataclasses import asdict

import torch

from .errors import DartLabError
from .config import GenerationConfig
from .generate import GenerationResult, count_new_tokens


def unavailable_reason(target) -> str | None:
    """None when llama.cpp can decode `target` here, else why not (one line)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python; it builds llama.cpp from source)"
    if gguf_path(target) is None:
        return f"target {target.name!r} has no GGUF file (the embedded target ships one)"
    if amx_build():
        return ("llama-cpp-python was built with llama.cpp's AMX matmul, which crashes the process on some AMX CPUs "
                "(ggml-org/llama.cpp#20824): rebuild it without, e.g. CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON "
                "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON' "
                "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python")
    return None


def amx_build() -> bool:
    """Whether the installed llama.cpp runs its AMX matmul: a build for an AMX CPU (`-march=native`) does, and
    its tile configuration is invalid there (a general-protection fault in `ggml_backend_amx_mul_mat` at the
    first forward, which no Python code can catch), so the bench skips it instead of dying with it."""
    import llama_cpp

    return b"AMX_INT8 = 1" in getattr(llama_cpp, "llama_print_system_info", lambda: b"")()


def gguf_path(target):
    """The GGUF the target was loaded from (the embedded one), or None."""
    from .loading import EMBEDDED_MODELS
    from .assets import embedded_file

    return embedded_file(target.name) if target.name in EMBEDDED_MODELS else None


class LlamaCpp:
    """`generate(prompt_ids, cfg) -> GenerationResult` through llama.cpp (greedy only)."""

    def __init__(self, target, n_ctx: int = 4096):
        why = unavailable_reason(target)
        if why:
            raise DartLabError(f"llamacpp: {why}")
        from llama_cpp import Llama

        self.target, self.threads = target, torch.get_num_threads()
        self.llm = Llama(model_path=str(gguf_path(target)), n_ctx=n_ctx, n_threads=self.threads,
                         n_threads_batch=self.threads, verbose=False)
        if self.llm.n_vocab() != target.vocab_size:
            raise DartLabError(f"llamacpp: the GGUF's vocabulary ({self.llm.n_vocab()}) is not the target's "
                               f"({target.vocab_size})")

    def generate(self, prompt_ids, cfg: GenerationConfig = GenerationConfig()) -> GenerationResult:
        """Greedy decoding of `prompt_ids` (T,); prefill_s = time to the first new token."""
        if not cfg.greedy:
            raise DartLabError("llamacpp runs greedy decoding only (--temperature 0)")
        ids = torch.as_tensor(prompt_ids).flatten().tolist()
        stop = self.target.eos_ids if cfg.stop_on_eos else frozenset()
        new, t0 = [], time.perf_counter()
        t1 = t0
        # llama-cpp-python keeps the KV of the longest prefix shared with its previous call (reset=True
        # included): forgotten here, so every prompt is prefilled from scratch, as our runners do
        self.llm.reset()
        # top_k=1: the argmax, whatever the other sampling settings; no repetition penalty (plain greedy)
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if not new:
                t1 = time.perf_counter()
            new.append(int(tok))
            if len(new) >= cfg.max_new_tokens or tok in stop:
                break
        t2 = time.perf_counter()
        new = count_new_tokens(new, self.target, cfg)
        return GenerationResult(method="llamacpp", tokens=new, prompt_tokens=len(ids), prefill_s=t1 - t0,
                                decode_s=t2 - t1, stop_reason="eos" if new and new[-1] in stop else "max_new_tokens",
                                config={"generation": asdict(cfg), "llamacpp": {"threads": self.threads,
                                                                                "gguf": gguf_path(self.target).name}},
                                text=self.target.decode(new) if self.target.tokenizer is not None else "")
