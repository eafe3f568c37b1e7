"""Regenerating the assistant turns of the training conversations with the target itself.

A draft head is judged on the target's own continuations, so training on text the target would write
(instead of ChatGPT's ShareGPT answers) can raise acceptance; EAGLE/Medusa-style pipelines do this.
The paper does not say whether DART did (paper/METHOD.md "Training").

    conversations (file order) --keep the user turns, first `max_turns` of them--> chunks of `chunk_size`
    each chunk: turn by turn, batched generation (left-padded, `batch_size` prompts of similar length)
    chunk_00003.jsonl written atomically -> an interrupted run resumes at the first missing chunk;
    the sampling seed is (seed, chunk index), so a resumed run writes what an uninterrupted one would.

Output rows are ShareGPT-shaped ({"id", "conversations": [{"from", "value"}]}), read back by
`iter_regenerated` and usable wherever ShareGPT records are (features.sharegpt_examples).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .atomic import atomic_file, write_json
from .data import ROLE, iter_sharegpt
from .errors import DartLabError


def _user_turns(rec: dict, max_turns: int) -> list[str] | None:
    """The first `max_turns` user messages of a ShareGPT record that starts with a user turn."""
    turns = rec.get("conversations") or []
    users = [t["value"] for t in turns if ROLE.get(str(t.get("from", "")).lower()) == "user"]
    if not turns or ROLE.get(str(turns[0].get("from", "")).lower()) != "user" or not users:
        return None
    users = [u for u in users[:max_turns] if isinstance(u, str) and u.strip()]
    return users or None


@torch.no_grad()
def _generate_batch(target, histories: list[list[dict]], max_new_tokens: int, temperature: float,
                    max_prompt_tokens: int) -> list[str]:
    tok = target.tokenizer
    prompts = [tok.apply_chat_template(h, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for h in histories]
    prompts = [list(p)[-max_prompt_tokens:] for p in prompts]  # long ShareGPT prompts: keep the end
    L = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(target.eos_ids)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    att = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, L - len(p):] = torch.tensor(p)
        att[i, L - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else dict(do_sample=False)
    out = target.model.generate(input_ids=ids.to(target.device), attention_mask=att.to(target.device),
                                max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=sorted(target.eos_ids),
                                **kw)
    return [tok.decode(o[L:], skip_special_tokens=True).strip() for o in out.cpu()]


def _write_jsonl(rows: list[dict], path: Path) -> None:
    with atomic_file(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _conversations(src, num: int, max_turns: int, max_prompt_tokens: int, tok_len) -> list[tuple[str, list[str]]]:
    """The first `num` records of `src` with a user turn whose first fits `max_prompt_tokens` (room left for the
    answer): (id, user turns) each."""
    convs = []
    for i, rec in enumerate(src):
        users = _user_turns(rec, max_turns)
        if users and tok_len(users[0]) <= max_prompt_tokens:
            convs.append((str(rec.get("id", i)), users))
        if len(convs) >= num:
            break
    return convs


def _regenerate_chunk(target, part, max_turns: int, max_new_tokens: int, temperature: float, batch_size: int,
                      max_prompt_tokens: int, tok_len) -> list[dict]:
    """One chunk's conversations answered turn by turn by the target, as ShareGPT rows."""
    hist = [[] for _ in part]
    for t in range(max_turns):
        live = [j for j, (_, users) in enumerate(part) if t < len(users)]
        for j in live:
            hist[j].append({"role": "user", "content": part[j][1][t]})
        live.sort(key=lambda j: tok_len(part[j][1][t]))  # similar lengths share a batch: less padding
        for b in range(0, len(live), batch_size):
            js = live[b:b + batch_size]
            for j, text in zip(js, _generate_batch(target, [hist[j] for j in js], max_new_tokens, temperature,
                                                   max_prompt_tokens)):
                hist[j].append({"role": "assistant", "content": text})
    return [{"id": cid, "regenerated_by": target.name,
             "conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in h]}
            for (cid, _), h in zip(part, hist)]


def regenerate(target, out_dir: str | Path, num: int, skip: int = 0, max_turns: int = 1, max_new_tokens: int = 256,
               temperature: float = 0.0, batch_size: int = 16, chunk_size: int = 64, seed: int = 0,
               max_prompt_tokens: int = 384, records=None, progress: bool = True) -> Path:
    """Regenerate the assistant turns of `num` conversations (ShareGPT from record `skip` on, or the
    given `records`). Writes out_dir/chunk_*.jsonl + out_dir/meta.json; returns out_dir."""
    if target.tokenizer is None:
        raise DartLabError("regeneration needs the target's tokenizer")
    if num < 1:
        raise DartLabError("regeneration needs num >= 1 conversations")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DartLabError(f"cannot create {out}: {e.strerror}") from None
    meta = {"target": target.name, "num": num, "skip": skip, "max_turns": max_turns, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed, "chunk_size": chunk_size, "max_prompt_tokens": max_prompt_tokens}
    mp = out / "meta.json"
    if mp.is_file() and json.loads(mp.read_text()) != meta:
        raise DartLabError(f"{out} holds a regeneration with other settings; use a new folder")
    write_json(mp, meta)

    def tok_len(text: str) -> int:
        return len(target.tokenizer(text)["input_ids"])

    src = records if records is not None else (r for i, r in enumerate(iter_sharegpt()) if i >= skip)
    convs = _conversations(src, num, max_turns, max_prompt_tokens, tok_len)
    if not convs:
        raise DartLabError("no conversations with a user turn to regenerate")
    bar = None
    if progress:
        bar = tqdm(total=len(convs), desc="regenerate", unit="conv")
    for c0 in range(0, len(convs), chunk_size):
        k = c0 // chunk_size
        path = out / f"chunk_{k:05d}.jsonl"
        part = convs[c0:c0 + chunk_size]
        if path.is_file():
            if bar is not None:
                bar.update(len(part))
            continue
        torch.manual_seed(seed * 100_003 + k)
        rows = _regenerate_chunk(target, part, max_turns, max_new_tokens, temperature, batch_size, max_prompt_tokens,
                                 tok_len)
        _write_jsonl(rows, path)
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()
    return out


def iter_regenerated(folder: str | Path):
    """ShareGPT-shaped records from a regeneration folder, in order."""
    chunks = sorted(Path(folder).glob("chunk_*.jsonl"))
    if not chunks:
        raise DartLabError(f"no regenerated conversations in {folder} (run `dart-lab regenerate` first)")
    for c in chunks:
        with open(c, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
