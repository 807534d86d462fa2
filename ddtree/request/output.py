"""A request's output as it is committed: its tokens, text, logprobs and finish reason.

A round's verdict, per row, is ``(accepted node indices with the root first, emitted tokens with the bonus
last)``; ``OutputState.write`` takes the tokens, stopping exactly at EOS, a stop token id, a stop string or
``max_new_tokens``, even in the middle of an accepted block (the KV packing of the accepted nodes is
``kv_cache.pack_buffers``; their logprobs ``logprobs.token_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddtree.errors import DDTreeError
from ddtree.request.detokenize import IncrementalDetokenizer
from ddtree.request.logprobs import TokenLogprobs
from ddtree.request.params import SamplingParams
from ddtree.request.text import overlap


@dataclass
class OutputState:
    """The tokens a request has produced so far, their text, and why it stopped, if it has.

    The text grows incrementally (``ddtree.request.detokenize``) and stop strings are looked for only where
    new text could complete one, so a round costs what its new tokens cost, however long the output.
    """

    params: SamplingParams
    eos_token_ids: frozenset[int]
    tokenizer: object | None = None
    skip_special_tokens: bool = True  # as vLLM's sampling parameter: False keeps them in the text
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # aligned with token_ids when requested
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if self.params.stop and self.tokenizer is None:
            raise DDTreeError(
                "stop strings need a tokenizer (and detokenize=True); pass stop_token_ids instead"
            )
        self._stop_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            self._stop_ids |= self.eos_token_ids
        self._detokenizer = (
            None
            if self.tokenizer is None
            else IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
        )
        self._pieces: list[str] = []  # the text, as it came
        self._unsent = ""  # its end that ``new_text`` has not handed out (a stop string may still cut it)
        self._tail = ""  # its last (longest stop - 1) characters: where a stop string may begin
        self._longest_stop = max(map(len, self.params.stop), default=0)

    def write(self, tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> int:
        """Append ``tokens`` (and their logprobs) up to the first stop: a stop token (not part of the text),
        a stop string (the token that completes it is the last one kept; the text ends before the string)
        or ``max_new_tokens``. Returns how many were kept."""
        taken = 0
        for i, token in enumerate(tokens):
            self.token_ids.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            taken += 1
            if token in self._stop_ids:
                self.finish_reason = "stop"
                break
            if self._detokenizer is not None:
                chunk = self._detokenizer.push(token)
                if chunk:
                    if self._add(chunk):
                        return taken
                elif self.params.stop and self._add(self._detokenizer.peek(), provisional=True):
                    # While a character's bytes are held, a decode of the whole output shows U+FFFD for
                    # them, and a stop string may end there (as it did before the text was incremental).
                    return taken
            if len(self.token_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.finish_reason is not None and self._detokenizer is not None:
            self._add(self._detokenizer.flush())  # an unfinished character's bytes, as decode writes them
        return taken

    def _add(self, chunk: str, provisional: bool = False) -> bool:
        """Append new text; True (finished: "stop") when it completes a stop string, the text then ending
        where that string begins. A ``provisional`` chunk (held bytes, as ``decode`` shows them) is only
        looked at: it is appended only when a stop string ends in it."""
        if not chunk:
            return False
        cut = None
        if self.params.stop:
            window = self._tail + chunk  # a stop string can only end in the new chunk
            hits = [i for i in (window.find(s) for s in self.params.stop) if i >= 0]
            if len(self.token_ids) < self.params.min_tokens:  # as vLLM: no stop before min_tokens
                hits = []
            if hits:
                cut = len(window) - min(hits)  # characters to drop from the end
            elif provisional:
                return False
            self._tail = window[max(0, len(window) - self._longest_stop + 1) :]
        self._pieces.append(chunk)
        self._unsent += chunk
        if cut is None:
            return False
        self._pieces = ["".join(self._pieces)[:-cut]]  # once per request
        self._unsent = self._unsent[: len(self._unsent) - cut]  # never sent: it was held as a stop prefix
        self.finish_reason = "stop"
        return True

    @property
    def text(self) -> str:
        """The whole text so far (cut at the stop string, if one was found)."""
        return "".join(self._pieces)

    def new_text(self) -> str:
        """The text not handed out before that can be streamed now: all of it once finished, else all but
        an end that may be the start of a stop string."""
        end = len(self._unsent)
        if self.finish_reason is None:
            end -= max((overlap(self._unsent, s) for s in self.params.stop), default=0)
        out, self._unsent = self._unsent[:end], self._unsent[end:]
        return out
