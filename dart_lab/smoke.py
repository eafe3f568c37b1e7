"""The notebooks' SMOKE switch: DART_LAB_SMOKE=1 shrinks loops so CI runs each notebook in minutes."""
import os

SMOKE = os.environ.get("DART_LAB_SMOKE", "0") not in ("", "0", "false", "False")


def pick(full, smoke):
    """`smoke` when DART_LAB_SMOKE is set, else `full`."""
    return smoke if SMOKE else full
