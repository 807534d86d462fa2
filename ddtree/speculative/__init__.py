"""The speculative round's own parts: the draft tree, the DFlash drafter, verification, sampling
and the budget."""
