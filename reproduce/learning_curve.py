"""A training run's learning curve, compact enough to ship with the head: the loss averaged over
windows of steps, and every evaluation (held-out acc-k, alpha, chain tau, decoding tau) with its step,
tokens seen and wall time.
    python reproduce/learning_curve.py RUN/log.jsonl OUT.json [BEFORE.json]
BEFORE: the curve of the run this one continued from (`dart-lab train --init-from`): its points come
first and this run's steps, tokens and wall time are counted on from its last point.
"""
import json
import sys
from pathlib import Path

WINDOW = 50


def main(log: str, out: str, before: str | None = None) -> None:
    rows = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    prev = json.loads(Path(before).read_text()) if before else {"loss": [], "evals": [], "source": []}
    if prev["loss"]:
        last = prev["loss"][-1]
        rows = [{**r, **{k: r[k] + last[k] for k in ("step", "tokens_seen", "elapsed_s")}} for r in rows]
    loss = []
    for i in range(0, len(rows), WINDOW):
        w = rows[i:i + WINDOW]
        loss.append({"step": w[-1]["step"], "tokens_seen": w[-1]["tokens_seen"], "elapsed_s": w[-1]["elapsed_s"],
                     "loss": round(sum(r["loss"] for r in w) / len(w), 4)})
    evals = [{k: r[k] for k in ("step", "tokens_seen", "elapsed_s", "val", "decode_tau") if k in r}
             for r in rows if "val" in r or "decode_tau" in r]
    src = prev["source"] if isinstance(prev["source"], list) else [prev["source"]]
    Path(out).write_text(json.dumps({"loss": prev["loss"] + loss, "evals": prev["evals"] + evals,
                                     "source": src + [str(log)]}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
