"""The drafting policy: what the tree budget (budget.py) and a batch (engine/batch.py) ask of a drafter beyond
the decode loop's begin / propose / observe (`generate.Drafter`). The controller owns one per drafter, a batch
asks each row's (`policy_for`).

The default policy is that of a drafter that drafts one tree a step from its own state, at whatever budget it is
given: its theta follows the acceptance it shows, its drafting cost does not depend on theta, and without a tree
it runs plain AR steps. A drafter that differs registers its own policy (`register`): DART's head forward runs
once for a batch's rows, EAGLE-3's cost grows with the tree's depth, dart-ctx (dart_ctx.py) decides per step.
"""
from __future__ import annotations

from .drafters import DartDrafter, Eagle3Drafter
from .generate import Drafter


class DraftPolicy:
    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def adapts(self, sampled: bool) -> bool:
        """Whether the budget re-chooses theta from the steps this drafter decodes (greedy, or sampled: T > 0);
        False keeps the calibration's theta (a drafter that picks which steps get a tree would bias the estimate)."""
        return True

    def wants_head(self, ids: list[int]) -> bool:
        """Whether this step's `propose(ids)` runs a DART head forward, which a batch runs once for all such rows
        (`drafters.draft_logits_batch`) and hands in as `propose(ids, logits)`."""
        return False

    def cost_scale(self, nodes: int, widest: int) -> float:
        """Drafting + search time with a budget of `nodes`, as a fraction of its time at `widest` (the
        calibration budget); the budget prices each theta with it."""
        return 1.0

    def set_cost_model(self, verify_ms: dict[int, float], overhead_ms: float, tau: list[float]) -> None:
        """The budget's measurements, for drafters that decide per step: verify ms by tree size, drafting +
        search ms per step, tau(theta) of the drafter's trees."""

    def without_tree(self, verify_ms: dict[int, float]) -> Drafter | None:
        """What runs when the budget finds that no tree beats AR: None = plain AR steps; a drafter that can
        draft without its head may return a drafter doing that."""
        return None

    def copy_offer(self, ids: list[int]) -> tuple[list[int], float]:
        """A batch's step without a tree (theta 0, several rows): a chain this drafter would verify alone and the
        chance each of its tokens is kept; ([], 0.0) = none."""
        return [], 0.0


class DartPolicy(DraftPolicy):
    def wants_head(self, ids: list[int]) -> bool:
        return True


class Eagle3Policy(DraftPolicy):
    def cost_scale(self, nodes: int, widest: int) -> float:
        d = self.drafter  # its head forwards dominate, and a small tree skips the deep levels' (`head_forwards`)
        return (1 + d.head_forwards(nodes)) / (1 + d.head_forwards(widest))


_POLICIES: dict[type, type] = {DartDrafter: DartPolicy, Eagle3Drafter: Eagle3Policy}


def register(drafter_type: type, policy_type: type) -> None:
    """Drafters of `drafter_type` (and its subclasses, unless they register their own) get `policy_type`."""
    _POLICIES[drafter_type] = policy_type


def policy_for(drafter: Drafter) -> DraftPolicy:
    """The policy of `drafter`: the one registered for the nearest class in its MRO, else the default."""
    for cls in type(drafter).__mro__:
        if cls in _POLICIES:
            return _POLICIES[cls](drafter)
    return DraftPolicy(drafter)
