"""dart_lab: learn, reproduce and extend DART parallel-drafting speculative decoding (arXiv 2601.19278)."""
from .config import GenerationConfig
from .errors import DartLabError
from .generate import Drafter, GenerationResult, generate, hf_generate
from .loading import load_target
from .target import Target
from .tree import Tree
from .acceptance import accept, greedy_accept, sample_accept, target_probs
from .engine.batch import BatchResult, generate_batch, hf_generate_batch
from .version import __version__  # noqa: F401

__all__ = ["GenerationConfig", "DartLabError", "Drafter", "GenerationResult", "generate", "hf_generate", "Target",
           "load_target", "Tree", "accept", "greedy_accept", "sample_accept", "target_probs",
           "BatchResult", "generate_batch", "hf_generate_batch"]
