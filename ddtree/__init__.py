"""ddtree: lossless speculative decoding with DDTree (Diffusion Draft Tree) over DFlash drafters.

``from ddtree import Engine, SamplingParams`` is the whole API for generation; ``Engine.from_pretrained()``
with no directories loads the built-in model pair.
"""

from importlib.metadata import PackageNotFoundError, version

from ddtree.errors import DDTreeError
from ddtree.request.params import SamplingParams, StructuredOutputs

try:
    __version__ = version("ddtree")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

__all__ = ["DDTreeError", "DFlashDrafter", "Engine", "SamplingParams", "StructuredOutputs", "__version__"]


def __getattr__(name: str):
    # The model classes import torch and transformers (seconds): only when asked for, so `ddtree --version`
    # and the server's protocol module stay light.
    if name == "Engine":
        from ddtree.engine import Engine

        return Engine
    if name == "DFlashDrafter":
        from ddtree.speculative.drafter import DFlashDrafter

        return DFlashDrafter
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
