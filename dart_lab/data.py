"""Evaluation prompts: MT-bench and HumanEval from their PyPI wheels, GSM8K / CodeAlpaca / Alpaca seed
tasks from DART_LAB_DATA, any jsonl file, and (hub access only) the paper's seven sets.

Every loader returns a list of {"id", "category", "prompt"} dicts in a fixed order, so two runs
with the same name and count benchmark the same prompts.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from .assets import data_dir, embedded_file
from .errors import DartLabError

# ShareGPT speaker names -> chat-template roles
ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
        "bing": "assistant", "assistant": "assistant", "system": "system"}

DATASETS = ("mt_bench", "humaneval", "gsm8k", "code_alpaca", "alpaca", "copy_edit")
# The paper's evaluation sets on the hub (Table 1), read from their data files directly (no loading script:
# `datasets` >= 4 refuses livecodebench's): name -> (dataset repo, data file glob, prompt fields, id field).
# Files as published on each repo (their paths are what hub.fetch_snapshot is asked for).
HUB_DATASETS = {
    "hub:alpaca": ("tatsu-lab/alpaca", "data/train-*.parquet", ("instruction", "input"), None),
    "hub:code_alpaca": ("sahil280114/codealpaca", "data/code_alpaca_20k.json", ("instruction", "input"), None),
    "hub:humaneval": ("openai/openai_humaneval", "openai_humaneval/test-*.parquet", ("prompt",), "task_id"),
    "hub:livecodebench": ("livecodebench/code_generation_lite", "test.jsonl", ("question_content",), "question_id"),
    "hub:math500": ("HuggingFaceH4/MATH-500", "test.jsonl", ("problem",), "unique_id"),
    "hub:mbpp": ("google-research-datasets/mbpp", "full/test-*.parquet", ("text",), "task_id"),
}


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DartLabError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
    return rows


def _with_input(instruction: str, inp: str) -> str:
    return f"{instruction}\n\n{inp}" if inp and inp.strip() else instruction


def _jsonl_prompts(path: Path) -> list[dict]:
    """MT-bench / Spec-Bench question format (first turn) or {"prompt": ...} / {"text": ...}."""
    if not path.is_file():
        raise DartLabError(f"jsonl dataset not found: {path}")
    out = []
    for i, r in enumerate(_read_jsonl(path)):
        if isinstance(r.get("turns"), list) and r["turns"]:
            text = r["turns"][0]
        else:
            text = r.get("prompt", r.get("text", r.get("instruction")))
        if not isinstance(text, str) or not text.strip():
            raise DartLabError(f"{path}: row {i + 1} has no 'turns', 'prompt', 'text' or 'instruction' string")
        out.append({"id": str(r.get("question_id", r.get("id", i))), "category": r.get("category", path.stem),
                    "prompt": text})
    return out


def load_prompts(name: str, n: int | None = None) -> list[dict]:
    """The first `n` prompts (all if None) of dataset `name` (see DATASETS, 'jsonl:PATH', HUB_DATASETS)."""
    if name == "mt_bench":
        rows = [{"id": str(r["question_id"]), "category": r["category"], "prompt": r["turns"][0]}
                for r in _read_jsonl(embedded_file("mt_bench"))]
    elif name == "humaneval":
        rows = [{"id": r["task_id"], "category": "humaneval",
                 "prompt": "Complete the following Python function.\n\n" + r["prompt"]}
                for r in _read_jsonl(embedded_file("humaneval"))]
    elif name == "gsm8k":
        rows = [{"id": f"gsm8k-test-{i}", "category": "gsm8k", "prompt": r["question"]}
                for i, r in enumerate(_read_jsonl(_data_file("gsm8k_test.jsonl")))]
    elif name == "code_alpaca":
        data = json.loads(_data_file("code_alpaca_2k.json").read_text(encoding="utf-8"))
        rows = [{"id": f"code-alpaca-{i}", "category": "code_alpaca", "prompt": _with_input(r["instruction"], r.get("input", ""))}
                for i, r in enumerate(data)]
    elif name == "alpaca":
        rows = []
        for r in _read_jsonl(_data_file("alpaca_seed_tasks.jsonl")):
            inst = (r.get("instances") or [{}])[0]
            rows.append({"id": r["id"], "category": "alpaca", "prompt": _with_input(r["instruction"], inst.get("input", ""))})
    elif name == "copy_edit":
        rows = _copy_edit_prompts()
    elif name.startswith("jsonl:"):
        rows = _jsonl_prompts(Path(name[len("jsonl:"):]).expanduser())
    elif name in HUB_DATASETS:
        rows = _hub_prompts(name)
    else:
        raise DartLabError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}, jsonl:PATH "
                           f"or (with hub access) {', '.join(HUB_DATASETS)}")
    if not rows:
        raise DartLabError(f"dataset {name!r} has no prompts")
    return rows if n is None else rows[:n]


def _copy_edit_prompts() -> list[dict]:
    """A copy-heavy set (built from the shared data, for the context-aware extension): "rewrite this
    function" over HumanEval solutions, alternating with "summarise this passage" over the longest
    Alpaca / CodeAlpaca inputs (>= 300 characters)."""
    rewrite = [{"id": f"rewrite-{r['task_id']}", "category": "rewrite",
                "prompt": "Rewrite the following Python function with clearer variable names and a docstring, "
                          "keeping its behaviour:\n\n" + r["prompt"] + r["canonical_solution"]}
               for r in _read_jsonl(embedded_file("humaneval"))]
    passages = []
    for r in _read_jsonl(_data_file("alpaca_seed_tasks.jsonl")):
        inp = (r.get("instances") or [{}])[0].get("input", "")
        passages.append((r["id"], inp))
    code = json.loads(_data_file("code_alpaca_2k.json").read_text(encoding="utf-8"))
    passages += [(f"code-alpaca-{i}", x.get("input", "")) for i, x in enumerate(code)]
    summarise = [{"id": f"summarise-{pid}", "category": "summarise",
                  "prompt": "Summarise this passage:\n\n" + text}
                 for pid, text in sorted(passages, key=lambda x: (-len(x[1]), x[0])) if len(text) >= 300]
    rows = []
    for i in range(max(len(rewrite), len(summarise))):
        rows += ([rewrite[i]] if i < len(rewrite) else []) + ([summarise[i]] if i < len(summarise) else [])
    return rows


def _data_file(name: str) -> Path:
    root = data_dir(required=True)
    path = root / name
    if not path.is_file():
        raise DartLabError(f"{name} not found in the data folder {root} (set DART_LAB_DATA)")
    return path


def _hub_prompts(name: str) -> list[dict]:
    """A paper set's prompts from its data files (`HUB_DATASETS`): parquet through pyarrow, a JSON array or
    JSON lines; the prompt is the first field, the second appended as in `_with_input` (Alpaca's input)."""
    from . import hub

    repo, pattern, fields, id_field = HUB_DATASETS[name]
    what = f"dataset {name}"
    files = sorted(hub.fetch_snapshot(repo, what, patterns=[pattern], repo_type="dataset").glob(pattern))
    if not files:
        raise DartLabError(f"{what}: {repo} has no file {pattern} (its layout changed?)")
    rows = []
    for f in files:
        rows += _table_rows(f, what)
    out = []
    for i, r in enumerate(rows):
        text = r.get(fields[0]) if isinstance(r, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise DartLabError(f"{what}: row {i + 1} of {repo}/{pattern} has no {fields[0]!r} text")
        extra = r.get(fields[1], "") if len(fields) > 1 else ""
        rid = r.get(id_field) if id_field else None
        out.append({"id": f"{name[4:]}-{rid if rid is not None else i}", "category": name[4:],
                    "prompt": _with_input(text, extra if isinstance(extra, str) else "")})
    return out


def _table_rows(path: Path, what: str) -> list[dict]:
    try:
        if path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DartLabError(f"{what} is a parquet file: install the paper extra (pip install -e '.[paper]')") from None
            return pq.read_table(path).to_pylist()
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise DartLabError(f"{what}: {path.name} is not a JSON array of rows")
            return data
        return _read_jsonl(path)
    except DartLabError:
        raise
    except Exception as e:  # a truncated parquet, bad JSON: pyarrow and json raise many types
        raise DartLabError(f"{what}: cannot read {path.name} ({(str(e).strip().splitlines() or [type(e).__name__])[0][:160]})") from None


# ----------------------------------------------------------------------------- ShareGPT
def iter_sharegpt(path: str | Path | None = None, limit: int | None = None):
    """Yield complete ShareGPT conversations ({"id", "conversations": [{"from", "value"}, ...]}).

    The packaged JSON array is cut off mid-record (the wheel caps it at 125 MB), so records are
    decoded one by one with `raw_decode` and the first undecodable (truncated) record ends the
    stream. Records without a non-empty list of turns are skipped: the packaged file holds 17,671
    complete records, 126 of them with an empty turn list, so 17,545 are yielded.
    """
    path = Path(path) if path else embedded_file("sharegpt")
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise DartLabError(f"{path} is not a ShareGPT JSON array")
    i += 1
    n, size = 0, len(text)
    while i < size and (limit is None or n < limit):
        while i < size and text[i] in " \t\r\n,":
            i += 1
        if i >= size or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # truncated tail
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if isinstance(turns, list) and turns and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns):
            n += 1
            yield rec
