"""A hub cache for the `paper-qwen3-*` presets, laid out as huggingface_hub lays out its own (blobs/, refs/main,
snapshots/<commit>/ linking into blobs/), every artifact in the form its source of truth gives it
(dart_lab/hub.py), at toy sizes: the offline rehearsal of the paper's path (HF_HUB_OFFLINE=1, HF_HUB_CACHE=it).

    python tests/fake_hub.py OUT        # writes OUT/ (about 1 MB), prints its size

- `Qwen/Qwen3-{1.7B,4B}`: a random 8-layer Qwen3 (bf16 safetensors, tied embedding as the small Qwen3s), with a
  byte-level BPE tokenizer trained here and a ChatML template (Qwen's special tokens).
- `fvliang/qwen{1.7b,4b}-dart`: config.json with the keys the released `DartConfig` / `LlamaForCausalLMDart`
  read, and model.safetensors without embed_tokens (the released loader copies the target's).
- `AngelSlim/Qwen3-{1.7B,4B}_eagle3`: 1.7B as `pytorch_model.bin` (fp16, model_type "llama": the file a third-party
  reading of that snapshot lists), 4B as `model.safetensors` with model_type "qwen3" (standing for the other
  model_type variant the project's issue reports; not a file we have seen); both with d2t / t2d and no embedding.
- `fvliang/dart-qwen3-ngram`: full.trie and small.trie in the released binary layout (`ngram.write_trie`).
- the six hub prompt sets (`data.HUB_DATASETS`): three rows each in their repos' own formats (parquet, a JSON
  array, JSON lines) with those datasets' column names.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path

import torch

SIZES = ("1.7B", "4B")
COMMIT = "0" * 40  # one snapshot per repo


def _repo_dir(cache: Path, repo: str, kind: str) -> Path:
    return cache / f"{kind}s--{repo.replace('/', '--')}"


def put(cache: Path, repo: str, files: dict, kind: str = "model") -> Path:
    """Write `files` {name: bytes} as repo's snapshot: content in blobs/<sha256>, the snapshot's entries
    relative links into it, refs/main naming the commit (huggingface_hub's cache layout)."""
    root = _repo_dir(cache, repo, kind)
    snap = root / "snapshots" / COMMIT
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def _files_of(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- prompts (their own formats)
ROWS = [("Write a function that reverses a string.", "hello"), ("Explain what a hash map is.", ""),
        ("Sum the even numbers below 100.", "")]


def datasets() -> dict:
    """repo -> {file: bytes}, as the paper's sets publish them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(cols: dict) -> bytes:
        buf = io.BytesIO()
        pq.write_table(pa.table(cols), buf)
        return buf.getvalue()

    ins, inp = [r[0] for r in ROWS], [r[1] for r in ROWS]
    jl = lambda rows: "".join(json.dumps(r) + "\n" for r in rows).encode()  # noqa: E731
    return {
        "tatsu-lab/alpaca": {"data/train-00000-of-00001-a09b74b3ef9c3b56.parquet": parquet(
            {"instruction": ins, "input": inp, "output": ["..."] * 3, "text": ["..."] * 3})},
        "sahil280114/codealpaca": {"data/code_alpaca_20k.json": json.dumps(
            [{"instruction": a, "input": b, "output": "..."} for a, b in ROWS]).encode()},
        "openai/openai_humaneval": {"openai_humaneval/test-00000-of-00001.parquet": parquet(
            {"task_id": [f"HumanEval/{i}" for i in range(3)], "prompt": [f"def f{i}(x):\n    \"\"\"{a}\"\"\"\n" for i, a in enumerate(ins)],
             "canonical_solution": ["    return x\n"] * 3, "test": ["def check(f): pass\n"] * 3, "entry_point": [f"f{i}" for i in range(3)]})},
        "livecodebench/code_generation_lite": {"test.jsonl": jl(
            [{"question_title": f"q{i}", "question_content": a, "platform": "atcoder", "question_id": f"abc{i}",
              "contest_id": "abc", "contest_date": "2023-05-01T00:00:00", "starter_code": "", "difficulty": "easy",
              "public_test_cases": "[]", "private_test_cases": "", "metadata": "{}"} for i, a in enumerate(ins)])},
        "HuggingFaceH4/MATH-500": {"test.jsonl": jl(
            [{"problem": a, "solution": "...", "answer": "1", "subject": "Algebra", "level": 1,
              "unique_id": f"test/algebra/{i}.json"} for i, a in enumerate(ins)])},
        "google-research-datasets/mbpp": {"full/test-00000-of-00001.parquet": parquet(
            {"task_id": [11, 12, 13], "text": ins, "code": ["pass"] * 3, "test_list": [["assert True"]] * 3,
             "test_setup_code": [""] * 3, "challenge_test_list": [[]] * 3})},
    }


# ----------------------------------------------------------------------------- target, heads, trie
def tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=384, special_tokens=special,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    chat = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=chat)


def target(tok, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper than random init: greedy paths and sampling are not flat
    return model


def _saved(obj_save) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        obj_save(Path(d))
        return _files_of(Path(d))


def _released_config(cfg, architecture: str, model_type: str, extra: dict) -> bytes:
    """config.json with the keys the released configs carry (DartConfig / EConfig read them as kwargs)."""
    d = {"architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
         "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
         "head_dim": cfg.hd, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
         "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
         "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", **extra}
    return json.dumps(d, indent=2).encode()


def heads(model, size: str, seed: int) -> tuple[dict, dict]:
    """(DART repo files, EAGLE-3 repo files) for a target `model`."""
    from safetensors.torch import save

    from dart_lab.draft_head import DartHead, Eagle3Head, HeadConfig

    torch.manual_seed(seed)
    vd = model.config.vocab_size - 64  # a reduced draft vocabulary: d2t / t2d carry the mapping
    ids = torch.randperm(model.config.vocab_size)[:vd].sort().values
    out = []
    for cls in (DartHead, Eagle3Head):
        head = cls(HeadConfig.for_target(model.config, draft_vocab_size=vd))
        head.set_vocab(ids)
        with torch.no_grad():
            head.lm_head.weight.mul_(8.0)
        out.append(head)
    dart, eagle = out
    dsd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in dart.state_dict().items()}
    dart_files = {"config.json": _released_config(dart.cfg, "LlamaForCausalLMDart", "llama", {"draft_length": 7}),
                  "model.safetensors": save(dsd)}
    esd = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in eagle.state_dict().items()}
    if size == "1.7B":
        buf = io.BytesIO()
        torch.save(esd, buf)
        eagle_files = {"config.json": _released_config(eagle.cfg, "LlamaForCausalLMEagle3", "llama", {"bias": False}),
                       "pytorch_model.bin": buf.getvalue()}
    else:
        eagle_files = {"config.json": _released_config(eagle.cfg, "LlamaForCausalLMEagle3", "qwen3", {"bias": False}),
                       "model.safetensors": save(esd)}
    return dart_files, eagle_files


def trie_files(tok, texts) -> dict:
    import tempfile

    from dart_lab.ngram import write_trie

    seqs = [tok(t, add_special_tokens=False).input_ids for t in texts]
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, part in (("full.trie", seqs), ("small.trie", seqs[: max(1, len(seqs) // 3)])):
            write_trie(Path(d) / name, part)
            out[name] = (Path(d) / name).read_bytes()
    return out


def build(cache: str | Path) -> Path:
    """Write the whole fake hub cache into `cache`; returns it."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    sets = datasets()
    for repo, files in sets.items():
        put(cache, repo, files, kind="dataset")
    texts = [a + "\n" + b for a, b in ROWS] * 4 + [
        "def add(a, b):\n    return a + b\n", "The answer is 42. Let me explain step by step.",
        "Here is a Python function that solves the problem:", "for i in range(10):\n    print(i)\n"] * 4
    tok = tokenizer(texts)
    for i, size in enumerate(SIZES):
        model = target(tok, seed=i)
        files = _saved(lambda d: (model.to(torch.bfloat16).save_pretrained(d), tok.save_pretrained(d)))
        put(cache, f"Qwen/Qwen3-{size}", files)
        dart, eagle = heads(model.float(), size, seed=10 + i)
        put(cache, f"fvliang/qwen{size.lower()}-dart", dart)
        put(cache, f"AngelSlim/Qwen3-{size}_eagle3", eagle)
    put(cache, "fvliang/dart-qwen3-ngram", trie_files(tok, texts))
    return cache


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/fake_hub.py OUT")
    out = build(sys.argv[1])
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"{out}: {size / 1e6:.2f} MB")
