"""ddtree: lossless speculative decoding with DDTree (Diffusion Draft Tree) over DFlash drafters."""

from ddtree.errors import DDTreeError
from ddtree.params import SamplingParams

__all__ = ["DDTreeError", "SamplingParams"]
