"""Training data for draft heads: ShareGPT rendered with the target's chat template, and a feature
cache from one target pass.

Each example: input_ids (T,), loss_mask (T,) True on assistant tokens, aux (T, 3H) — the three
auxiliary hidden states — and final (T, H), the target's last hidden state after its final norm, from
which the target logits (soft labels) are recomputed with its lm_head at training time
(H floats per token instead of V).

Shards are safetensors files written atomically (`shard_00012.safetensors`); an interrupted
extraction resumes at the first missing shard with the same data order.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .atomic import atomic_file
from .data import ROLE, iter_sharegpt
from .errors import DartLabError
from .regenerate import iter_regenerated


def render_conversation(tokenizer, turns: list[dict], max_len: int) -> tuple[list[int], list[bool]] | None:
    """Render [{"from", "value"}] with the chat template. Returns (ids, assistant mask) truncated to
    max_len, or None if nothing trainable remains. The mask is found by rendering growing prefixes
    (the template must be prefix-stable, as chat templates are)."""
    msgs = []
    for t in turns:
        role = ROLE.get(str(t.get("from", "")).lower())
        if role is None or not t["value"].strip():
            return None
        msgs.append({"role": role, "content": t["value"]})
    if not msgs or not any(m["role"] == "assistant" for m in msgs):
        return None

    def render(ms, gen=False):
        out = tokenizer.apply_chat_template(ms, add_generation_prompt=gen, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    ids = render(msgs)
    mask = [False] * len(ids)
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = len(render(msgs[:k], gen=True)) if k else 0
        end = min(len(render(msgs[:k + 1])), len(ids))
        for i in range(start, end):
            mask[i] = True
        if start >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    return (ids, mask) if sum(mask) >= 8 else None


def _regenerated(conversations: str | Path | None):
    """Records of a `dart-lab regenerate` folder, or None (= ShareGPT itself)."""
    if conversations is None:
        return None
    return iter_regenerated(conversations)


def sharegpt_examples(tokenizer, max_len: int = 512, limit: int | None = None, skip: int = 0, records=None,
                      max_turns: int = 0):
    """Yield (conversation id, ids, mask) for complete ShareGPT conversations, in file order (or from
    `records`, e.g. regenerated ones); max_turns > 0 keeps the first user/assistant exchanges only."""
    n = 0
    for i, rec in enumerate(iter_sharegpt() if records is None else records):
        if i < skip:
            continue
        turns = rec["conversations"][:2 * max_turns] if max_turns else rec["conversations"]
        r = render_conversation(tokenizer, turns, max_len)
        if r is None:
            continue
        yield rec.get("id", str(i)), r[0], r[1]
        n += 1
        if limit is not None and n >= limit:
            return


def _save_shard(path: Path, tensors: dict, meta: dict) -> None:
    with atomic_file(path) as tmp:
        save_file(tensors, tmp, metadata={"json": json.dumps(meta)})


@torch.no_grad()
def target_pass(target, ids: list[int], mask: list[bool]) -> dict:
    """One training example from one target forward: input_ids (T,) int32, loss_mask (T,) bool,
    aux (T, 3H) the inputs of the three aux layers, final (T, H) the last hidden state (after the norm),
    on the target's device and dtype."""
    x = torch.tensor(ids, device=target.device)[None]
    o = target.model.base_model(input_ids=x, output_hidden_states=True)
    return {"input_ids": torch.tensor(ids, dtype=torch.int32), "loss_mask": torch.tensor(mask, dtype=torch.bool),
            "aux": torch.cat([o.hidden_states[i][0] for i in target.aux_layers], -1),
            "final": o.last_hidden_state[0]}


@torch.no_grad()
def write_features(target, examples, out_dir: str | Path, num_examples: int, split: str = "train",
                   shard_size: int = 64, dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> Path:
    """Run the target over `examples` ((id, ids, assistant mask) triples) and write shards.
    Shards already on disk are skipped (resume); the example order fixes the shard contents."""
    out = Path(out_dir) / split
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DartLabError(f"cannot create feature folder {out}: {e.strerror}") from None
    n_shards = (num_examples + shard_size - 1) // shard_size
    todo = {s for s in range(n_shards) if not (out / f"shard_{s:05d}.safetensors").is_file()}
    bar = None
    if progress:
        bar = tqdm(total=num_examples, initial=(n_shards - len(todo)) * shard_size, desc=f"features {split}", unit="seq")
    buf, shard, count = [], 0, 0
    for ex in examples:
        buf.append(ex)
        count += 1
        if len(buf) < shard_size and count < num_examples:
            continue
        if shard in todo:
            tensors, meta = {}, {"ids": [], "target": target.name}
            for j, (cid, ids, mask) in enumerate(buf):
                ex = target_pass(target, ids, mask)
                for k, v in ex.items():
                    tensors[f"{j}.{k}"] = v.to(dtype).cpu() if v.is_floating_point() else v.cpu()
                meta["ids"].append(str(cid))
                if bar is not None:
                    bar.update(1)
            _save_shard(out / f"shard_{shard:05d}.safetensors", tensors, meta)
        buf, shard = [], shard + 1
        if count >= num_examples:
            break
    if bar is not None:
        bar.close()
    if count == 0:
        raise DartLabError("no usable examples for feature extraction (dataset empty?)")
    return out


def extract_features(target, out_dir: str | Path, num_examples: int, max_len: int = 512, shard_size: int = 64,
                     dtype: torch.dtype = torch.bfloat16, split: str = "train", skip: int = 0,
                     progress: bool = True, conversations: str | Path | None = None, max_turns: int = 0) -> Path:
    """One target pass over `num_examples` conversations (starting after `skip`): ShareGPT, or the
    regenerated ones in `conversations` (a `dart-lab regenerate` folder)."""
    if target.tokenizer is None:
        raise DartLabError("feature extraction needs the target's tokenizer")
    examples = sharegpt_examples(target.tokenizer, max_len, limit=num_examples, skip=skip,
                                 records=_regenerated(conversations), max_turns=max_turns)
    return write_features(target, examples, out_dir, num_examples, split, shard_size, dtype, progress)


class FeatureDataset:
    """Examples from feature shards, as dicts of tensors. Deterministic order = shard order."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.shards = sorted(self.folder.glob("shard_*.safetensors"))
        if not self.shards:
            raise DartLabError(f"no feature shards in {self.folder} (run feature extraction first)")
        self.index = []
        for s in self.shards:
            with safe_open(str(s), "pt") as f:
                n = len({k.split(".")[0] for k in f.keys()})
            self.index.extend((s, j) for j in range(n))
        self._open = {}  # shard -> safe_open handle (memory-mapped; an example reads only its tensors)

    def __len__(self) -> int:
        return len(self.index)

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of example i (its hidden states are not read)."""
        f, j = self._handle(i)
        return f.get_tensor(f"{j}.input_ids"), f.get_tensor(f"{j}.loss_mask")

    def _handle(self, i: int):
        """(safe_open handle of example i's shard, its index there)."""
        shard, j = self.index[i]
        f = self._open.get(shard)
        if f is None:
            f = self._open[shard] = safe_open(str(shard), "pt")
        return f, j

    def __getitem__(self, i: int) -> dict:
        # training reads examples in random order: loading whole shards (~140 MB for 64 examples)
        # per example cost more than the head's step; reading one example's tensors costs ~1 ms
        f, j = self._handle(i)
        return {k: f.get_tensor(f"{j}.{k}") for k in ("input_ids", "loss_mask", "aux", "final")}


class OnlineFeatures:
    """The same examples as a feature cache, computed by the target when asked (target in the loop:
    no disk, for GPU boxes where a forward of the target is cheap next to the storage a cache needs).
    `examples`: (id, ids, assistant mask) triples, rendered once up front."""

    def __init__(self, target, examples):
        self.target = target
        self.examples = [(ids, mask) for _, ids, mask in examples]
        if not self.examples:
            raise DartLabError("no usable examples for online training (dataset empty?)")

    def __len__(self) -> int:
        return len(self.examples)

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = self.examples[i]
        return torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool)

    def __getitem__(self, i: int) -> dict:
        return target_pass(self.target, *self.examples[i])


def online_features(target, num_train: int, num_val: int = 64, max_len: int = 512, val_skip: int = 17000,
                    conversations: str | Path | None = None, max_turns: int = 0) -> dict:
    """{"train", "val"} OnlineFeatures over the same conversations `extract_features` would store."""
    if target.tokenizer is None:
        raise DartLabError("online training needs the target's tokenizer")
    train = sharegpt_examples(target.tokenizer, max_len, limit=num_train, records=_regenerated(conversations),
                              max_turns=max_turns)
    val = sharegpt_examples(target.tokenizer, max_len, limit=num_val, skip=val_skip, max_turns=max_turns)
    return {"train": OnlineFeatures(target, train), "val": OnlineFeatures(target, val) if num_val else None}
