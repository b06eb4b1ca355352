"""Pieces of the answers: ``Job`` (a validated request), OpenAI finish reasons, usage,
and logprobs in OpenAI's two shapes: the completions API's parallel lists (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and the chat API's ``content`` list of
``{token, logprob, bytes, top_logprobs}``. Token strings come from the tokenizer one token
at a time (a token holding part of a UTF-8 character reads as U+FFFD)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity


@dataclass
class Job:
    """One validated request: its prompts as token ids, its sampling parameters, and what to
    put in the answer."""

    kind: str  # "completion" | "chat"
    rid: str
    prompts: list[list[int]]
    texts: list[str]  # prompt texts (for echo)
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # alternatives per token, None = no logprobs
    echo_only: bool = False  # max_tokens=0 with echo: the engine's one token is dropped
    prompt_logprobs: int | None = None  # the vLLM-style field: alternatives per prompt token


def without_generated(out: RequestOutput) -> RequestOutput:
    """``out`` as a max_tokens=0 echo answers it: no generated text, tokens or logprobs, and
    a finished sequence ends by "length" (unless aborted or failed)."""
    outs = [
        replace(o, text="", token_ids=[], logprobs=None if o.logprobs is None else [],
                stop_reason=None,
                finish_reason="length" if o.finish_reason in ("stop", "length")
                else o.finish_reason)
        for o in out.outputs
    ]  # fmt: skip
    return replace(out, outputs=outs)


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._decoded: dict[int, str] = {}

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def _token(self, tid: int) -> str:
        s = self._decoded.get(tid)
        if s is None:
            s = self._decoded[tid] = self.decode([tid])
        return s

    def _top(self, entry: dict[int, Any], k: int) -> list[tuple[int, float]]:
        items = sorted(entry.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))
        return [(t, _lp(v.logprob)) for t, v in items[:k]]

    def completion(
        self, tokens: list[int], entries: list[Any], k: int, offset: int
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for tid, entry in zip(tokens, entries, strict=False):
            s = self._token(tid)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(entry[tid].logprob) if tid in entry else None)
            out["top_logprobs"].append({self._token(t): v for t, v in self._top(entry, k)})
        return out

    def prompt(self, ids: list[int], entries: list[Any] | None, k: int) -> list[Any]:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else the token
        and the ``k`` most likely, ``{token id: {logprob, rank, decoded_token}}``."""
        out: list[Any] = [None]
        for tid, entry in zip(ids[1:], (entries or [None])[1:], strict=False):
            keep = [(t, v) for t, v in entry.items() if t == tid or v.rank <= k]
            out.append({
                str(t): {"logprob": _lp(v.logprob), "rank": v.rank, "decoded_token": self._token(t)}
                for t, v in keep
            })  # fmt: skip
        return out

    def chat(self, entries: list[Any] | None, k: int) -> dict[str, Any]:
        content = []
        for entry in entries or []:
            tid = next(iter(entry))  # the sampled token comes first
            s = self._token(tid)
            tops = [
                {"token": self._token(t), "logprob": v, "bytes": list(self._token(t).encode())}
                for t, v in self._top(entry, k)
            ]
            content.append({"token": s, "logprob": _lp(entry[tid].logprob),
                            "bytes": list(s.encode()), "top_logprobs": tops})  # fmt: skip
        return {"content": content}


def _lp(v: float) -> float:
    return v if math.isfinite(v) else LOGPROB_FLOOR


def reason_of(r: str | None) -> str | None:
    """OpenAI's finish reasons: stop and length pass, an abort reads as stop."""
    return None if r is None else ("length" if r == "length" else "stop")


def usage_of(outs: list[RequestOutput]) -> dict[str, int]:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(x.token_ids) for o in outs for x in o.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
