"""Configuration as frozen dataclasses of plain values.

Every result records `dataclasses.asdict(cfg)`, so a number can always be traced to the settings
that produced it. Validation happens in `__post_init__` and raises `DartLabError` with one line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import DartLabError


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode: length, stop rule and the target's sampling distribution.

    temperature == 0 means greedy (argmax); otherwise logits / temperature, then top-k (0 = off),
    then top-p (1.0 = off) define the distribution that speculative decoding must preserve.
    """

    max_new_tokens: int = field(default=128, metadata={"help": "tokens to generate"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (1.0 = off)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0 = off)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    stop_on_eos: bool = field(default=True, metadata={"help": "stop at the target's EOS"})

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
