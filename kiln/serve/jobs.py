"""From an OpenAI request to a ``Job``: validation against the server's limits (model,
unsupported and unknown fields, token ids, the context), ``SamplingParams``, and prompts
(chat templates included)."""

from __future__ import annotations

import logging
from typing import Any

from kiln.errors import ConfigError
from kiln.sampling_params import SamplingParams
from kiln.serve.config import ServeConfig
from kiln.serve.errors import APIError, from_config_error
from kiln.serve.metrics import ServerMetrics
from kiln.serve.protocol import ChatCompletionRequest, CompletionRequest, new_id
from kiln.serve.responses import Job, LogprobFormatter

log = logging.getLogger("kiln.serve")
UNSUPPORTED = ("tools", "tool_choice", "suffix", "parallel_tool_calls")


class JobBuilder:
    """The validating half of ``Generation``: requests in, ``Job``s out."""

    def __init__(self, llm: Any, config: ServeConfig, metrics: ServerMetrics) -> None:
        self.llm, self.config, self.metrics = llm, config, metrics
        self.tok = llm.tokenizer
        self.vocab: int = llm.config.vocab_size
        cap = config.max_model_len or llm.max_seq_len
        self.max_model_len = min(cap, llm.max_seq_len)
        self.fmt = LogprobFormatter(self.tok)
        self.ignored_fields = 0

    # ---- validation --------------------------------------------------------------------

    def _common(self, req: CompletionRequest | ChatCompletionRequest, prompts: int) -> None:
        c = self.config
        if req.model is not None and req.model != c.model_name:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {c.model_name!r}.",
                param="model",
                code="model_not_found",
            )
        extra = sorted(req.model_extra or {})
        if extra:
            names = ", ".join(n[:40] for n in extra[:10])
            if c.reject_unknown_fields:
                raise APIError(
                    400,
                    f"unknown field(s): {names} (this server rejects unknown fields).",
                    param=extra[0][:40],
                    code="unknown_field",
                )
            self.ignored_fields += len(extra)
            log.info("ignoring unknown request field(s): %s", names)
        for name in UNSUPPORTED:
            v = getattr(req, name, None)
            if v not in (None, [], "none"):
                raise APIError(400, f"{name} is not supported by this server.", param=name)
        rf = getattr(req, "response_format", None)
        if rf is not None and rf.get("type", "text") != "text":
            raise APIError(
                400, "only response_format type 'text' is supported.", param="response_format"
            )
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs is not available with stream=true; leave "
                           "one of them out.", param="prompt_logprobs")  # fmt: skip
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server.", param="logit_bias")
        if req.n * prompts > c.max_n:
            raise APIError(
                400,
                f"n={req.n} is invalid: at most {c.max_n} choices per request "
                f"(n times {prompts} prompt(s)).",
                param="n",
            )
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > c.max_stop_strings:
            raise APIError(
                400,
                f"stop=<{len(stops)} strings> is invalid: at most {c.max_stop_strings} strings.",
                param="stop",
            )

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{param} is empty: at least one token is required.", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise APIError(
                400,
                f"{param} holds token ids {bad[:5]} outside [0, {self.vocab}).",
                param=param,
                code="invalid_token_id",
            )
        return ids

    def _max_tokens(self, asked: int | None, plen: int, param: str) -> int:
        room = self.max_model_len - plen
        if room < 1 or (asked is not None and asked > room):
            want = f"{plen} prompt tokens" + (f" plus max_tokens {asked}" if asked else "")
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"the request needs {want}; shorten the prompt or lower max_tokens.",
                param=param if room >= 1 else ("messages" if param != "max_tokens" else "prompt"),
                code="context_length_exceeded",
            )
        return asked if asked is not None else room

    def _params(self, req: CompletionRequest | ChatCompletionRequest, **kw: Any) -> SamplingParams:
        try:
            return SamplingParams(
                n=req.n,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                min_tokens=min(req.min_tokens, kw["max_tokens"]),
                **kw,
            )
        except ConfigError as e:
            raise from_config_error(e) from None

    def completion_job(self, req: CompletionRequest) -> Job:
        p = req.prompt
        items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items:
            raise APIError(400, "prompt is empty: at least one token is required.", param="prompt")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported.", param="best_of")
        self._common(req, len(items))
        prompts, texts = [], []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError(400, "prompt is empty: send some text.", param="prompt")
                ids = self._check_ids(self.tok.encode(item), "prompt")
                texts.append(item)
            else:  # checked before decoding: an id outside the vocabulary names the field
                ids = self._check_ids(list(item), "prompt")
                texts.append(self.fmt.decode(ids))
            prompts.append(ids)
        longest = max(len(i) for i in prompts)
        echo_only = req.max_tokens == 0  # the prompt back (with its logprobs), nothing new
        if echo_only and not req.echo:
            raise APIError(400, "max_tokens=0 is invalid without echo=true: ask for at least "
                           "1 token, or set echo for the prompt (and its logprobs) alone.",
                           param="max_tokens")  # fmt: skip
        mt = self._max_tokens(1 if echo_only else req.max_tokens, longest, "max_tokens")
        lp = req.logprobs
        params = self._params(
            req,
            max_tokens=mt,
            logprobs=lp,
            prompt_logprobs=_most(lp if req.echo else None, req.prompt_logprobs),
        )
        job = self._job("completion", req, prompts, texts, params, req.echo, lp)
        job.echo_only = echo_only
        return job

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        self._common(req, 1)
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        try:
            text = self.tok.apply_chat_template(messages)
        except ConfigError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # the template raised (e.g. raise_exception on a bad role)
            raise APIError(400, f"the chat template failed: {e}.", param="messages") from None
        ids = self._check_ids(self.tok.encode(text, add_special_tokens=False), "messages")
        asked = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        mt = self._max_tokens(asked, len(ids), name)
        lp = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, max_tokens=mt, logprobs=lp, prompt_logprobs=req.prompt_logprobs)
        return self._job("chat", req, [ids], [text], params, False, lp)

    def _job(self, kind: str, req: Any, prompts: list[list[int]], texts: list[str],
             params: SamplingParams, echo: bool, lp: int | None) -> Job:  # fmt: skip
        so = req.stream_options
        return Job(
            kind=kind,
            rid=new_id("cmpl" if kind == "completion" else "chatcmpl"),
            prompts=prompts,
            texts=texts,
            params=params,
            n=req.n,
            stream=req.stream,
            include_usage=bool(so and so.include_usage),
            echo=echo,
            logprobs=lp,
            prompt_logprobs=req.prompt_logprobs,
        )


def _most(a: int | None, b: int | None) -> int | None:
    """The larger of two optional counts (None: not asked)."""
    return b if a is None else a if b is None else max(a, b)
