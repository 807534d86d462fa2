"""``ddtree bench``: tau, TPOT and speedup of ar / dflash / ddtree and HF baselines on the same prompts.

``metrics`` defines every number, ``runner`` produces the per-response records, ``check`` is the T = 0
losslessness check, ``report`` and ``plots`` write the outputs, ``cli`` is the command.
"""
