"""What dart-ctx does when its automatic budget finds no tree that beats AR: now `drafters.CopyOrAR`
(copy chains where they beat a one-token step), before plain AR steps. copy_edit, 10 prompts x 128
tokens, the two interleaved per prompt, end-to-end tokens/s (prefill included).

    .venv/bin/python reproduce/fallback_copy_speed.py [TEMPERATURE]     (default 1.0)
"""
import json
import sys

import dart_lab as dl
from dart_lab.budget import cost_curve
from dart_lab.data import load_prompts
from dart_lab.methods import make_drafter

T = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
t = dl.load_target("smollm2-135m")
d = make_drafter("dart-ctx", t)
fb = d.without_tree(cost_curve(t)["verify_ms"])
cfg = dl.GenerationConfig(max_new_tokens=128, temperature=T)
prompts = load_prompts("copy_edit")[:10]
tot = {"ar": [0, 0.0], "copy-or-ar": [0, 0.0]}
for i, p in enumerate(prompts):
    ids = t.encode_prompt(p["prompt"])
    for name, dr in (("ar", None), ("copy-or-ar", fb)):
        r = dl.generate(t, ids, dr, cfg)
        tot[name][0] += len(r.tokens)
        tot[name][1] += r.prefill_s + r.decode_s
        print(i, name, len(r.tokens), round(r.prefill_s + r.decode_s, 2), round(r.tau, 2),
              sum(1 for s in r.steps if s.get("copy_only")), flush=True)
ar, c = (tot[k][0] / tot[k][1] for k in ("ar", "copy-or-ar"))
print(json.dumps({"T": T, "ar_tok_s": round(ar, 2), "copy_or_ar_tok_s": round(c, 2), "speedup": round(c / ar, 3)}))
