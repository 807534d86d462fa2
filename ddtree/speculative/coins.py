"""Position-keyed coins: the uniform a sampled request uses for its t-th output token is a pure function of
(its key, t), so its sample does not depend on the method, the tree, the budget or the batch.

Every sampled request owns a key (its ``seed``; an unseeded one draws a key at admission). The coin of
output position t is a counter-based hash of (key, t) (Salmon et al.'s counter-based idea, with
Wellons' 32-bit "lowbias32" finaliser), computed as int64 tensor ops where the coins are needed: no
generator state, no host sync, no per-request loop. Every intermediate product stays below 2**63
(32-bit values times 31-bit odd constants), so it is exact on every device and under ``torch.compile``.

The token at position t is ``inverse_cdf(filtered target distribution, coin(key, t))`` in natural
vocabulary order, for ``ar``, ``dflash`` and ``ddtree`` alike: plain decoding emits it, and tree
verification computes it at the node it stands on and moves to the child holding it (else emits it as the
bonus). Lossless by construction, and equal to plain decoding's seeded output wherever the verify
forward's probabilities equal the plain forward's.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63 (no int64 overflow).
MULTIPLIERS = (0x7FEB352D, 0x46C8A68B)
STREAM = 0x5BD1E995  # separates the key's two halves from the position in the first mix


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche of ``x`` (int64 holding values in [0, 2**32)), elementwise."""
    x = x ^ (x >> 16)
    x = (x * MULTIPLIERS[0]) & MASK32
    x = x ^ (x >> 15)
    x = (x * MULTIPLIERS[1]) & MASK32
    return x ^ (x >> 16)


def key_of(seed: int) -> int:
    """A request's key from its seed (any int ``torch.Generator`` takes: [-2**63, 2**64)): the seed modulo
    2**63, a non-negative int64."""
    return int(seed) % (1 << 63)


def coins_at(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) (multiples of 2**-24) for ``keys`` (int64, broadcast against positions)
    at output ``positions`` (int64): coin(key, t), the same on every device."""
    keys, positions = torch.broadcast_tensors(keys.long(), positions.long())
    lo, hi = keys & MASK32, (keys >> 32) & MASK32
    h = mix32(lo ^ mix32(hi ^ mix32((positions & MASK32) ^ STREAM)))
    return (h >> 8).float() * (1.0 / (1 << 24))
