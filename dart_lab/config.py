"""Configuration as frozen dataclasses of plain values.

Every result records `dataclasses.asdict(cfg)`, so a number can always be traced to the settings
that produced it. Validation happens in `__post_init__` and raises `DartLabError` with one line.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import DartLabError


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode: length, stop rule and the target's sampling distribution.

    temperature == 0 means greedy (argmax); otherwise logits / temperature, then top-k (0 = off),
    then top-p (1.0 = off) define the distribution that speculative decoding must preserve.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise DartLabError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise DartLabError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise DartLabError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise DartLabError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
