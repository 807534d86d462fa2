"""Token ids as OpenAI shows them in logprobs: a string and its UTF-8 bytes.

A token can hold part of a character, so its bytes are the truth and its string is those bytes decoded
with U+FFFD for the incomplete part. Byte-level BPE tokenizers (Qwen, Llama 3, GPT-2) give exact bytes
through the GPT-2 byte alphabet; other tokenizers fall back to decoding the single token.
"""

from __future__ import annotations

import json
from functools import lru_cache


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's reversible map from bytes to printable characters, inverted: character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF = _byte_alphabet()


class TokenNames:
    """Cached ``id -> (string, bytes)`` for one tokenizer (None: ids are shown as ``<id>``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self.lookup = lru_cache(maxsize=1 << 16)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        tok = self.tokenizer
        if tok is None:
            text = f"<{token_id}>"
            return text, list(text.encode())
        piece = tok.convert_ids_to_tokens(token_id)
        if piece is None:
            text = f"<{token_id}>"
            return text, list(text.encode())
        if token_id in self.special:
            return piece, list(piece.encode())
        if self.byte_level and all(ch in _BYTE_OF for ch in piece):
            raw = bytes(_BYTE_OF[ch] for ch in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = tok.decode([token_id])
        return text, list(text.encode())


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return False
    return "ByteLevel" in json.dumps(decoder)
