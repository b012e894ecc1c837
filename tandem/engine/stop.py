"""Incremental detokenisation and stop checks for one request, independent of any model.

`StopChecker.append(token_id)` is called once per generated token. It keeps:

* `token_ids`: every generated id, including the one that stopped the request (EOS or a
  stop_token_id), as vLLM keeps it in its output token ids;
* `text`: the detokenised output, grown incrementally with vLLM's prefix/read offsets: a window of
  recent ids is decoded and only the part past the already-emitted prefix is appended, and nothing
  is appended while the window's text ends with U+FFFD (an incomplete UTF-8 sequence from a
  byte-level token). The token that stops the request (EOS / stop_token_id) is not detokenised
  unless include_stop_str_in_output. On finishing, bytes still held back are flushed, so for a
  byte-level tokenizer `text == decode(detokenised ids)` exactly (a final incomplete character
  shows as U+FFFD, as decode shows it);
* `finish_reason` ("stop" or "length", or what `finish()` was given) and `stop_reason` (the
  matched stop string or stop token id; None for EOS and length).

Stop rules (vLLM v0's order: EOS, stop_token_ids, stop strings, then max_tokens): none of EOS,
stop_token_ids or stop strings ends the request until more than `min_tokens` tokens were generated
(the sampler masks EOS / stop ids over the same first min_tokens tokens); EOS is ignored with
ignore_eos. A stop string may span tokens; only the new text plus the longest stop string's length
is searched; the earliest match wins; the text is cut before it, or after it with
include_stop_str_in_output. `delta()` gives streaming text, holding back the last
max_stop_len - 1 characters until the request finishes, since they may still become a stop string.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tandem.engine.sampling_params import SamplingParams

STOP, LENGTH, ABORT = "stop", "length", "abort"
PROMPT_CONTEXT_TOKENS = 5   # prompt ids decoded before the output for correct spacing (vLLM's offset)
_REPLACEMENT = "\ufffd"


class StopChecker:
    """Output state of one request: ids, incremental text, stop decision, streaming deltas."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int],
                 decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.decode = decode                  # the engine binds skip_special_tokens into it
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._max_stop = params.max_stop_len
        # Detokenisation window: prompt context then the detokenised output ids.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._prefix = 0                      # window start: decoded only as context
        self._read = len(self._ids)           # ids before this are already in text
        self._emitted = 0                     # chars of text handed out by delta()

    @property
    def finished(self) -> bool:
        """True once a finish reason is set; append() must not be called again."""
        return self.finish_reason is not None

    def append(self, token_id: int) -> str | None:
        """Add one generated token; return "stop" or "length" when the request must end, else None."""
        if self.finished:
            raise RuntimeError(f"request already finished ({self.finish_reason}); cannot append")
        token_id = int(token_id)
        self.token_ids.append(token_id)
        p = self.params
        may_stop = len(self.token_ids) > p.min_tokens
        if may_stop and not p.ignore_eos and token_id in self.eos_token_ids:
            return self._finish_on_token(token_id, None)
        if may_stop and token_id in self.stop_token_ids:
            return self._finish_on_token(token_id, token_id)
        new_chars = self._detokenize(token_id)
        if may_stop and self._check_stop_strings(new_chars):
            return self.finish_reason
        if p.max_tokens is not None and len(self.token_ids) >= p.max_tokens:
            self.finish(LENGTH)
        return self.finish_reason

    def extend(self, token_ids: Iterable[int]) -> str | None:
        """Append several tokens (e.g. speculative ones), stopping at the first that finishes."""
        for t in token_ids:
            if self.append(t) is not None:
                break
        return self.finish_reason

    def finish(self, reason: str = ABORT, stop_reason: str | int | None = None) -> None:
        """End the request from outside (e.g. "length" at the context limit, "abort"); flushes text."""
        if self.finished:
            return
        self.finish_reason, self.stop_reason = reason, stop_reason
        self._flush()

    def delta(self) -> str:
        """Text new since the last call, withholding a possible stop-string prefix until finished."""
        end = len(self.text)
        if not self.finished and self._max_stop > 1:
            end -= self._max_stop - 1
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    # -- internals -------------------------------------------------------------------------------

    def _finish_on_token(self, token_id: int, stop_reason: int | None) -> str:
        if self.params.include_stop_str_in_output:
            self._detokenize(token_id)
        self.finish(STOP, stop_reason)
        return STOP

    def _detokenize(self, token_id: int) -> int:
        """vLLM's incremental detokenisation step; returns how many chars were added to text."""
        self._ids.append(token_id)
        prefix_text = self.decode(self._ids[self._prefix:self._read])
        new_text = self.decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return 0      # nothing printable yet, or an incomplete UTF-8 sequence: wait for more
        added = new_text[len(prefix_text):]
        self.text += added
        self._prefix, self._read = self._read, len(self._ids)
        return len(added)

    def _flush(self) -> None:
        """Append text still held back (an incomplete trailing character decodes to U+FFFD)."""
        if self._read == len(self._ids):
            return
        prefix_text = self.decode(self._ids[self._prefix:self._read])
        new_text = self.decode(self._ids[self._prefix:])
        self._prefix, self._read = self._read, len(self._ids)
        if len(new_text) > len(prefix_text):
            added = new_text[len(prefix_text):]
            self.text += added
            if self.stop_reason is None and len(self.token_ids) > self.params.min_tokens:
                before = self.finish_reason
                self.finish_reason = None      # let the stop-string check record its reason
                if not self._check_stop_strings(len(added)):
                    self.finish_reason = before

    def _check_stop_strings(self, new_chars: int) -> bool:
        """Search the new tail for the earliest stop string; on a match truncate text and finish."""
        if not new_chars or not self.params.stop:
            return False
        start = max(0, len(self.text) - new_chars - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        cut = i + len(s) if self.params.include_stop_str_in_output else i
        self.text = self.text[:cut]
        self._emitted = min(self._emitted, cut)
        self.finish_reason, self.stop_reason = STOP, s
        self._prefix = self._read = len(self._ids)   # nothing left to flush past a stop string
        return True
