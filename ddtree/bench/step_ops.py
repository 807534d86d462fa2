"""What a decode step asks of torch outside its graphs: on an accelerator every eager op is a kernel launch
(and a host-side dispatch), so this is the launch count that capturing a round removes or leaves.

A ``TorchDispatchMode`` counts the aten calls a step makes (views, which launch nothing, left out). The two
forwards, and the round's graphs (tree, verify inputs, acceptance, KV pack) where they are
compiled, count as one call each: they run with the counter popped, so a compiled function still runs
compiled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

FORWARDS = ("verify_forward", "draft_forward")
ROUND_GRAPHS = ("tree_graph", "inputs_graph", "accept_graph", "pack_graph")


class OpCounter(TorchDispatchMode):
    """Counts non-view aten calls by name, and the calls of the functions ``apart`` wraps."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def apart(self, name: str, fn: Callable) -> Callable:
        """``fn`` counted as one call, its own ops not."""

        def run(*args, **kwargs):
            self.calls[name] += 1
            with _pop_mode_temporarily():
                return fn(*args, **kwargs)

        return run


def count_steps(engine, steps: int) -> tuple[float, float, OpCounter]:
    """Run ``steps`` engine steps under an ``OpCounter``: eager ops per step, calls of the forwards and
    graphs per step, and the counter. The round's graphs count apart only when compiled (uncompiled they
    are the eager ops being measured)."""
    runner, shapes = engine.runner, engine.runner.shapes
    owners = [(runner, name) for name in FORWARDS]
    owners += [(shapes, name) for name in ROUND_GRAPHS] if shapes.round_compiled else []
    saved = {(owner, name): getattr(owner, name) for owner, name in owners}
    counter = OpCounter()
    for (owner, name), fn in saved.items():
        setattr(owner, name, counter.apart(name, fn))
    try:
        with counter:
            for _ in range(steps):
                engine.step()
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)
    return sum(counter.ops.values()) / steps, sum(counter.calls.values()) / steps, counter
