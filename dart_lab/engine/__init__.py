"""The engine: the fast paths under the method (our C++ kernels, the lean Llama-family runner, 4-bit weights,
batched decoding). Importing it plugs its versions of the method's ops into `dart_lab.fast` (`ops`)."""
from . import head, ops  # noqa: F401
