"""The continuously batched engine (``ddtree.engine.engine.Engine``) and the parts it is made of, one
responsibility a file: ``request`` (state and results), ``scheduler`` (who runs, which row), ``model_runner``
(weights, caches, shapes, forwards), ``proposer`` (drafts and trees), ``verifier`` (verify, accept, commit)
and ``auto_budget`` (the ``budget="auto"`` policy)."""

from ddtree.engine.engine import Engine, check_engine_options
from ddtree.engine.request import STAGES, GenerationResult, GenerationStats, Request, StreamDelta
from ddtree.request.params import METHODS

__all__ = [
    "METHODS",
    "STAGES",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "Request",
    "StreamDelta",
    "check_engine_options",
]
