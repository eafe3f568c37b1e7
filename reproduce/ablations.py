"""Training ablations of the paper on the embedded target (short runs): the gamma sweep (Table 4) and
shifted vs unshifted first logit (Table 3).

    python reproduce/ablations.py --features runs/features --runs runs/ablate --steps 300

Every run is `dart-lab train dart` on the same feature cache, data order, seed and step count; only
gamma (or --unshifted) changes. Runs go `--parallel` at a time with cores/parallel threads each, resume
when interrupted (the trainer's checkpoints) and are skipped when their summary.json exists. Results:
reproduce/results/embedded/gamma_sweep.json and shift_ablation.json, rendered by reproduce/run_all.ipynb.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dart_lab.atomic import write_json
from dart_lab.features import FeatureDataset

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", default="runs/features")
    ap.add_argument("--runs", default="runs/ablate")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--gammas", default="0.5,0.6,0.7,0.8,0.9,1.0")
    ap.add_argument("--val-examples", type=int, default=64)
    ap.add_argument("--noise-seeds", default="1", help="extra seeds of gamma 0.6: run-to-run noise ('' = none)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--results", default=str(ROOT / "reproduce/results/embedded"))
    args = ap.parse_args()
    runs = Path(args.runs)
    if not (Path(args.features) / "train").is_dir():
        print(f"error: no feature cache at {args.features} (run `dart-lab features` first)", file=sys.stderr)
        return 2
    common = ["--features", args.features, "--max-steps", str(args.steps), "--val-every", str(args.steps),
              "--val-examples", str(args.val_examples), "--save-every", "50", "--seqs-per-step", "2"]
    jobs = {f"gamma_{g}": ["--gamma", g] for g in args.gammas.split(",")}
    jobs["unshifted_0.6"] = ["--gamma", "0.6", "--unshifted"]
    # The same setting with another seed (data order, anchors, init of the new weights): the noise that a
    # difference between two rows must exceed before it means anything.
    seeds = [int(x) for x in args.noise_seeds.split(",") if x.strip()]
    jobs.update({f"seed_{s}_gamma_0.6": ["--gamma", "0.6", "--seed", str(s)] for s in seeds})
    threads = max(1, (os.cpu_count() or 1) // args.parallel)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    exe = [sys.executable, "-m", "dart_lab"]
    todo = [k for k in jobs if not (runs / k / "summary.json").is_file()]
    running: dict[str, subprocess.Popen] = {}
    t0 = time.time()
    while todo or running:
        while todo and len(running) < args.parallel:
            k = todo.pop(0)
            (runs / k).mkdir(parents=True, exist_ok=True)
            log = open(runs / k / "train.log", "a")
            running[k] = subprocess.Popen(exe + ["train", "dart", "--out", str(runs / k)] + common + jobs[k],
                                          stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            print(f"[{time.time() - t0:6.0f}s] started {k}", flush=True)
        time.sleep(5)
        for k, p in list(running.items()):
            if p.poll() is not None:
                del running[k]
                print(f"[{time.time() - t0:6.0f}s] {k} exited {p.returncode}", flush=True)
                if p.returncode:
                    print(f"error: {k} failed, see {runs / k / 'train.log'}", file=sys.stderr)
                    return 1

    def row(k):
        s = json.loads((runs / k / "summary.json").read_text())
        v = s["validation"]
        return {"alpha": v["alpha"], "acc": v.get("acc"), "hit10": v.get("hit10"), "tau_chain": v["tau_chain"],
                "val_loss": v["val_loss"], "anchors": v.get("anchors"), "steps": s["steps"],
                "tokens_seen": s["tokens_seen"], "wall_time_s": s["wall_time_s"], "config": s["config"]}

    how = {"command": "python reproduce/ablations.py " + " ".join(sys.argv[1:]), "target": "smollm2-135m",
           "features": {"train_conversations": len(FeatureDataset(Path(args.features) / "train")),
                        "val_conversations": args.val_examples},
           "definitions": "alpha: conditional chain acceptance per level; acc: unconditional top-1 per level; "
                          "hit10: target token in the draft's top 10; tau_chain: simulated greedy chain tau "
                          "(held-out ShareGPT conversations, teacher-forced prefix)"}
    noise = [{"seed": 0, **row("gamma_0.6")}] + [{"seed": s, **row(f"seed_{s}_gamma_0.6")} for s in seeds]
    def spread(values):
        return round(max(values) - min(values), 4)
    spread = {"tau_chain": spread([r["tau_chain"] for r in noise]), "acc_1": spread([r["acc"][0] for r in noise])}
    sweep = {**how, "rows": [{"gamma": float(k.split("_")[1]), **row(k)} for k in jobs if k.startswith("gamma_")],
             "noise": {"rows": noise, "spread": spread,
                       "what": "gamma 0.6 trained with different seeds; spread = max - min over the seeds"}}
    write_json(Path(args.results) / "gamma_sweep.json", sweep)
    shift = {**how, "rows": [{"variant": "shifted", **row("gamma_0.6")}, {"variant": "unshifted", **row("unshifted_0.6")}]}
    write_json(Path(args.results) / "shift_ablation.json", shift)
    for r in sweep["rows"]:
        print(f"gamma {r['gamma']}: acc {r['acc']} tau_chain {r['tau_chain']}")
    for r in shift["rows"]:
        print(f"{r['variant']}: acc {r['acc']} hit10 {r['hit10']}")
    print(f"noise (gamma 0.6, seeds {[r['seed'] for r in noise]}): spread {spread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
