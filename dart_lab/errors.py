"""One error type for everything a user can get wrong.

`DartLabError` carries a single line that names the problem; the CLI prints it without a
traceback and exits non-zero. It subclasses ValueError so library users can catch either.
"""


class DartLabError(ValueError):
    """A user-facing problem (bad input, missing asset, mismatched head), stated in one line."""
