"""Incremental detokenization with stop strings, for streaming.

Token ids arrive a few at a time; ``update`` returns the text that became *final*:

* Never broken UTF-8. A token may carry part of a multi-byte character (byte-level BPE
  splits emoji and CJK across tokens); while the decoded text ends with U+FFFD the
  incomplete character is held back (the complete ones before it are released); only
  invalid bytes (U+FFFD after ``MAX_STALLED_UPDATES`` updates) come out as U+FFFD. Text is
  found by the prefix-offset / read-offset technique (vLLM, TGI): decode a short window of
  the previous tokens with and without the new ones and take the difference, so the cost
  per token does not grow with the output, and tokenizers whose decoding of a token depends
  on its left neighbour (SentencePiece's leading-space handling) still get it right. (The
  window only grows while every update ends inside a character.)
* Stop strings are matched in the text, across token boundaries. The first stop string to
  *complete* wins (earliest end; at equal ends the longer one), which is what token-by-token
  streaming sees whatever the chunking. The text is cut at the match's start (at its end
  with ``include_stop_str_in_output``), everything after it is dropped, ``finished`` becomes
  True and ``stop_reason`` names the string.
* While streaming, the longest tail of the text that is still a proper prefix of some stop
  string (so at most max stop length - 1 characters) is held back, so a delta never holds
  text that a later match cuts. ``flush()``, called when the sequence ends for another
  reason, releases it together with any incomplete character (as U+FFFD).

All deltas plus ``flush()`` concatenate to ``text``."""

from __future__ import annotations

from kiln.sampling_params import SamplingParams
from kiln.tokenizer import Tokenizer

# Prompt tokens decoded as left context for the first output tokens (vLLM's choice).
PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"
# A UTF-8 character has at most 4 bytes: text that still ends in U+FFFD after this many
# updates without a new complete character holds invalid bytes, released as they are.
MAX_STALLED_UPDATES = 8
MAX_CONTEXT_TOKENS = 16  # read tokens kept as left context when nothing visible arrives


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas; see the module docstring.

    Attributes: ``text`` (the output text so far, including what is held back, and what the
    user gets once the sequence ends), ``stop_reason`` (the stop string that matched, or
    None) and ``finished`` (True once a stop string matched; later updates are ignored)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stops: list[str] = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._flushed = False
        self._sent = 0  # characters of text already returned
        # tokens from the prefix offset on; the first _read of them are already in text
        self._window: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._partial = 0  # characters of the unread tokens' text already released
        self._stalled = 0  # updates in a row that ended incomplete and released nothing

    def update(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text that became final (possibly "")."""
        if self.finished or self._flushed:
            return ""
        self._window.extend(new_token_ids)
        return self._consume(self._decode(force=False), final=False)

    def flush(self) -> str:
        """The sequence ended (eos, stop token, length, abort): return everything held back,
        an incomplete trailing character included. Later updates are ignored."""
        if self.finished or self._flushed:
            self._flushed = True
            return self._take(len(self.text))
        self._flushed = True
        return self._consume(self._decode(force=True), final=True)

    # ---- internals ---------------------------------------------------------------------

    def _decode(self, force: bool) -> str:
        """New text of the window's unread tokens, up to an incomplete last character unless
        ``force``; the tokens stay unread until their text is complete."""
        if len(self._window) == self._read:
            return ""
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self._window[: self._read], skip_special_tokens=skip)
        full = self.tokenizer.decode(self._window, skip_special_tokens=skip)
        new = full[len(prefix) :]
        if not force and full.endswith(_INCOMPLETE) and self._stalled < MAX_STALLED_UPDATES:
            # A character still incomplete: keep the tokens unread, so the next decode has
            # them, but release the complete characters before it.
            done = new.rstrip(_INCOMPLETE)
            out = done[self._partial :]
            self._partial = max(self._partial, len(done))
            self._stalled = 0 if out else self._stalled + 1
            return out
        self._stalled = 0
        if not force and not new:
            # Nothing visible (a skipped special token, an id that decodes to nothing): the
            # tokens join the context, which stays bounded.
            self._window = self._window[-MAX_CONTEXT_TOKENS:]
            self._read = len(self._window)
            return ""
        out = new[self._partial :]
        self._partial = 0
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return out

    def _consume(self, delta: str, final: bool) -> str:
        """Append decoded text, look for a stop string in it, return what is now final."""
        if delta:
            before = len(self.text)
            self.text += delta
            hit = self._find_stop(before)
            if hit is not None:
                start, stop = hit
                self.text = self.text[: start + len(stop) if self.include_stop else start]
                self.finished, self.stop_reason = True, stop
        if self.finished or final:
            return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback())

    def _take(self, end: int) -> str:
        out = self.text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    def _find_stop(self, before: int) -> tuple[int, str] | None:
        """The stop string that completes first among the matches ending after ``before``
        (matches ending earlier were looked for when that text arrived)."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stops:
            i = self.text.find(stop, max(0, before - len(stop) + 1))
            if i >= 0:
                cand = (i + len(stop), -len(stop), stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return None if best is None else (best[0] + best[1], best[2])

    def _holdback(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string.
        Nothing is held with ``include_stop_str_in_output``: a match then only cuts text
        after its end, which has not arrived yet."""
        if self.include_stop:
            return 0
        held = 0
        for stop in self.stops:
            if len(stop) - 1 <= held:
                continue
            tail = self.text[-(len(stop) - 1) :]
            i = tail.find(stop[0])
            while i != -1 and len(tail) - i > held:
                if stop.startswith(tail[i:]):
                    held = len(tail) - i
                    break
                i = tail.find(stop[0], i + 1)
        return held
