"""The package's layout as a contract: the import graph has no circle and no arrow up a floor, the method's files
import nothing from the engine or the budget, and modules and functions stay readable in one sitting."""
import ast
from pathlib import Path

import torch

PKG = Path(__file__).resolve().parent.parent / "dart_lab"

# floors, bottom up: a module imports only from its own floor or below (the engine's modules among themselves
# only without a circle)
FLOORS = [
    {"errors", "version", "smoke", "fast", "machine", "atomic", "config", "assets", "hub", "data", "cost"},
    {"tree", "acceptance", "target", "ngram", "search", "builders", "draft_head", "generate", "drafters"},  # the method
    {"policy", "dart_ctx", "measure", "regenerate", "features", "losses", "viz"},
    {"engine", "engine.kernels", "engine.q4", "engine.int4", "engine.attention", "engine.step", "engine.runner",
     "engine.head", "engine.ops", "engine.on_device", "engine.batch_target", "engine.batch"},
    {"budget", "loading", "llamacpp"},
    {"methods", "train", "bench", "presets", "tables", "cli", "__main__", "exercise"},
]
METHOD = FLOORS[1]
ENGINE_OR_BUDGET = FLOORS[3] | {"budget", "measure", "policy"}
EXEMPT_FUNCTIONS = {("cli.py", "build_parser")}  # an argument table


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG).with_suffix("").parts
        name = ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)
        out[name] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its text (top level or inside functions);
    "" is the package's face (`dart_lab/__init__.py`)."""
    mods = _modules()
    graph = {}
    for name, p in mods.items():
        pkg = name.split(".") if p.name == "__init__.py" else name.split(".")[:-1]
        pkg = [x for x in pkg if x]
        seen = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg[:len(pkg) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                elif (node.module or "").startswith("dart_lab"):
                    base = node.module.split(".")[1:]
                else:
                    continue
                for a in node.names:
                    cand = ".".join(base + [a.name])
                    seen.add(cand if cand in mods else ".".join(base))
            elif isinstance(node, ast.Import):
                seen |= {".".join(a.name.split(".")[1:]) for a in node.names if a.name.startswith("dart_lab.")}
        graph[name] = {m for m in seen if m in mods and m != name}
    return graph


def _floor(name: str) -> int:
    return next(i for i, f in enumerate(FLOORS) if name in f)


def test_every_module_has_a_floor():
    assert set(_modules()) - {""} == set().union(*FLOORS)


def test_the_import_graph_has_no_circle():
    graph = {k: v - {""} for k, v in import_graph().items() if k}
    state, path, circles = {}, [], []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                circles.append(path[path.index(m):] + [m])
            elif m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not circles, f"import circles: {circles}"


def test_no_import_runs_up_a_floor():
    up = [(a, b) for a, bs in import_graph().items() if a for b in bs if b and _floor(b) > _floor(a)]
    assert not up, f"imports up a floor: {up}"


def test_the_method_imports_nothing_from_the_engine_or_the_budget():
    graph = import_graph()
    bad = {(m, b) for m in METHOD for b in graph[m] if b in ENGINE_OR_BUDGET or b == ""}
    assert not bad, f"the method's files reach into the engine or the budget: {sorted(bad)}"


def test_modules_and_functions_are_readable_in_one_sitting():
    long_modules = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    long_functions = []
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60 and (p.name, node.name) not in EXEMPT_FUNCTIONS:
                    long_functions.append((str(p.relative_to(PKG)), node.name, n))
    assert not long_modules, f"modules over 600 lines: {long_modules}"
    assert not long_functions, f"functions over 60 lines: {long_functions}"


def test_the_method_runs_on_its_references_alone(monkeypatch):
    """With the engine's table emptied (`fast`), DART still decodes, on the method's references only, the tokens
    it decodes with the engine's ops plugged in, and both are greedy AR's (fp32)."""
    from conftest import tiny_target
    from dart_lab import GenerationConfig, fast, generate
    from dart_lab.drafters import DartDrafter
    from dart_lab.methods import random_head
    from dart_lab.ngram import NGram
    from dart_lab.search import TreeSearchConfig

    target = tiny_target("llama", runner="fast")
    g = torch.Generator().manual_seed(0)
    ngram = NGram.from_sequences([torch.randint(3, target.vocab_size, (200,), generator=g).tolist()], target.vocab_size)
    head = random_head(target, "dart")
    prompt, cfg = list(range(3, 20)), GenerationConfig(max_new_tokens=24)

    def dart():
        return generate(target, prompt, DartDrafter(head, ngram, TreeSearchConfig(max_nodes=20)), cfg)

    plugged = dart()
    assert fast._OPS, "the engine plugged nothing in"
    monkeypatch.setattr(fast, "_OPS", {})
    alone = dart()
    assert alone.tokens == plugged.tokens == generate(target, prompt, None, cfg).tokens
    assert [s["tree_size"] for s in alone.steps] == [s["tree_size"] for s in plugged.steps]
