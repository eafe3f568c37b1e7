"""The cost model of the tree budget theta (beyond the paper: the released code fixes 60): pure functions of
measured curves and tau, no I/O, no timing (those are `measure.py`; the controller that uses them, `budget.py`).

    expected speed(theta) = tau(theta) / (t_verify(theta + 1) + t_draft + t_search)   [tokens / ms]
    AR speed              = 1 / t_verify(1)

t_verify(N) is measured once per target, device, dtype, runner and machine (`cost_curve`, cached on
disk with that fingerprint), after a short and a long committed context; a request prices its trees
at its own context length (`curve_at`: the attention over the cache makes every node dearer there).
tau(theta) -- tokens per step with a tree of theta drafted nodes -- comes from ONE decode at the widest
budget: both tree builders take nodes in rank order (`tree.best_closed_tree`), so the tree of any
smaller budget is exactly the nodes of rank < theta, and at T=0 the path it
would have accepted is the prefix of the accepted path whose ranks are < theta
(`acceptance_profile`). The runner takes the theta with the best expected speed, or plain AR steps
when no theta beats AR (and says so), and keeps updating tau from the steps it decodes.
On a GPU t_verify is nearly flat in N and theta comes out large; on a 2-core CPU it does not.
"""
from __future__ import annotations


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The curve made non-decreasing in N, without letting one noisy size move the others. A bigger tree
    cannot cost less, but readings are noisy both ways (a small size read above a bigger one; the widest
    tree read low, and a running minimum from the widest down would then set every size, and the
    per-token context growth of every size, to that reading). So: 1. a size that breaks the
    order with a neighbour while its two neighbours agree with each other is a lone outlier and takes
    that neighbour's value (an interior one first, from the readings; then the smallest size is lowered
    to its neighbour when above it, the widest raised to its neighbour when below it); 2. what still
    decreases is pooled into its mean (pool-adjacent-violators: the least-squares non-decreasing fit).
    A clean rising curve is unchanged, and one far-off reading moves no other size."""
    ns = sorted(curve)
    raw = [float(curve[n]) for n in ns]
    v = list(raw)
    lone = {i for i in range(1, len(v) - 1) if raw[i - 1] <= raw[i + 1] and not raw[i - 1] <= raw[i] <= raw[i + 1]}
    lone -= {j for i in lone for j in (i, i + 1) if i + 1 in lone}  # two neighbours out of order: no lone one
    for i in lone:
        v[i] = raw[i - 1] if raw[i] < raw[i - 1] else raw[i + 1]
    if len(v) >= 3:
        v[0] = min(v[0], v[1])
        v[-1] = max(v[-1], v[-2])
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for x in v:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s_, c = blocks.pop()
            blocks[-1][0] += s_
            blocks[-1][1] += c
    out = [b[0] / b[1] for b in blocks for _ in range(b[1])]
    return dict(zip(ns, out))


def padded(curve: dict[int, float], buckets) -> dict[int, float]:
    """The curve of a runner that pads each step's nodes to the next of `buckets` (compiled steps,
    `runner.FastTarget.node_buckets`): every size from 1 to the widest measured, each at its bucket's
    cost (beyond the last bucket, where steps run eager, as measured). Interpolating between measured
    buckets instead priced 3 nodes between 2 and 4 although they run as 4, and drafted trees that lost."""
    widest = max(curve)  # measured there, it ran padded too: its reading is its bucket's cost
    return {n: interpolate(curve, min(next((b for b in sorted(buckets) if b >= n), n), widest))
            for n in range(1, widest + 1)}


def curve_at(cost: dict, context: int) -> dict[int, float]:
    """The verify curve {N: ms} after `context` committed tokens: the short-context curve plus each
    size's growth per token beyond its context (linear: attention reads every cached key once per node;
    none below it). A cost dict without the growth (made by hand) is its own curve at any context."""
    per_token = cost.get("context_ms_per_token")
    extra = max(context - cost.get("prompt_len", 0), 0)
    if not per_token or not extra:
        return cost["verify_ms"]
    return {n: ms + per_token.get(n, 0.0) * extra for n, ms in cost["verify_ms"].items()}


def interpolate(curve: dict[int, float], n: int) -> float:
    """Verify ms at n nodes, linear between measured sizes (flat beyond the ends)."""
    xs = sorted(curve)
    if n <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return curve[a] + (curve[b] - curve[a]) * (n - a) / (b - a)
    return curve[xs[-1]] * n / xs[-1]  # beyond the widest measured tree: grow proportionally


def expected_copy_tokens(p: float, L: int) -> float:
    """Tokens a step verifying a copy chain of L tokens alone emits on average, each copy token kept
    with probability p given its predecessors: 1 (the bonus) + p + p^2 + ... + p^L."""
    return 1.0 + sum(float(p) ** i for i in range(1, L + 1))


def copy_cap(offers: list[tuple[list[int], float]], verify_ms: dict[int, float]) -> int:
    """A step without a tree (theta 0) that may still verify copies: how many tokens of each row's copy
    chain to verify. Every row's chain is cut to one cap L (the rows of a batch share the step's width),
    chosen for the most expected tokens per ms,
        sum_b E(p_b, min(L_b, L)) / t(L + 1)      (L = 0: a plain AR step for every row),
    offers: per row (chain, p = the chance each copy token is kept); verify_ms: the step's cost by nodes
    per row (the batch's curve at this many rows; one row: the batch-1 curve)."""
    widest = max((len(c) for c, _ in offers), default=0)
    # gained[L]: sum_b (E(p_b, min(L_b, L)) - 1), each row's terms p_b^i added once (a step prices every cap)
    gained = [0.0] * (widest + 1)
    for chain, p in offers:
        term, acc = 1.0, 0.0
        for L in range(1, widest + 1):
            if L <= len(chain):
                term *= float(p)
                acc += term
            gained[L] += acc
    best, best_rate = 0, len(offers) / interpolate(verify_ms, 1)
    for L in range(1, widest + 1):
        rate = (len(offers) + gained[L]) / interpolate(verify_ms, L + 1)
        if rate > best_rate:
            best, best_rate = L, rate
    return best


def acceptance_profile(steps: list[dict], max_nodes: int) -> list[float]:
    """tau(theta) for theta = 0..max_nodes from decode steps that recorded `path_ranks` (T=0): a step
    emits 1 + (accepted nodes of rank < theta) tokens with a budget of theta."""
    ranked = [s["path_ranks"] for s in steps if "path_ranks" in s]
    if not ranked:
        return [1.0] * (max_nodes + 1)
    return [1.0 + sum(sum(1 for r in rs if r < th) for rs in ranked) / len(ranked) for th in range(max_nodes + 1)]


def overhead_at(means: dict[int, float], theta: int, scale=None) -> float:
    """Drafting + search ms per step at budget `theta` from the per-theta means measured so far
    (`means`: theta -> ms), following the drafter's cost shape scale(theta) (`draft_cost_scale`:
    EAGLE-3's head forwards grow with the tree's depth up to its depth limit, DART's one forward does
    not). Between two measured budgets a and b: the same fraction of the way from a's cost to b's as
    scale(theta) is from scale(a) to scale(b) (linear in theta where the shape is flat: EAGLE-3 at
    theta 10 already runs all 8 forwards of theta 63, where a line from theta 4 to theta 63 would price
    it near theta 4); beyond them: the nearest one times scale(theta) / scale(nearest)."""
    xs = sorted(means)
    if not xs:
        return 0.0
    s = scale or (lambda th: 1.0)
    for a, b in zip(xs, xs[1:]):
        if a <= theta <= b:
            span = s(b) - s(a)
            frac = (s(theta) - s(a)) / span if abs(span) > 1e-9 else (theta - a) / (b - a)
            return means[a] + (means[b] - means[a]) * min(max(frac, 0.0), 1.0)
    near = xs[0] if theta < xs[0] else xs[-1]
    return means[near] * s(theta) / max(s(near), 1e-9)


def choose_budget(tau: list[float], verify_ms: dict[int, float], overhead_ms) -> dict:
    """The theta with the best expected speed; theta 0 (plain AR steps) when none beats AR.
    overhead_ms: drafting + search ms per step, a number (every theta alike) or a function of theta."""
    ar = 1.0 / interpolate(verify_ms, 1)
    over = [0.0] + [overhead_ms(th) if callable(overhead_ms) else overhead_ms for th in range(1, len(tau))]
    speed = [ar] + [tau[th] / (interpolate(verify_ms, th + 1) + over[th]) for th in range(1, len(tau))]
    best = max(range(len(speed)), key=lambda th: (speed[th], -th))
    return {"theta": best, "expected_speedup_vs_ar": speed[best] / ar,
            "expected_speedup_by_theta": [round(v / ar, 4) for v in speed],
            "overhead_ms": over[best],
            "overhead_ms_by_theta": [round(v, 3) for v in over[1:]],
            "fallback_to_ar": best == 0}


def interpolate_batch(curves: dict[int, dict[int, float]], rows: int) -> dict[int, float]:
    """The verify curve {N: ms} at `rows` live rows, linear between the two measured batch sizes around it
    (`curves`: batch size -> curve; beyond the largest: proportional to the rows)."""
    bs = sorted(curves)
    lo = max((b for b in bs if b <= rows), default=bs[0])
    hi = min((b for b in bs if b >= rows), default=bs[-1])
    ns = sorted(set(curves[lo]) & set(curves[hi]))
    if lo == hi:
        scale = rows / lo if rows > lo else 1.0
        return {n: curves[lo][n] * scale for n in ns}
    f = (rows - lo) / (hi - lo)
    return {n: curves[lo][n] + f * (curves[hi][n] - curves[lo][n]) for n in ns}
