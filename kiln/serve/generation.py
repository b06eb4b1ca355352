"""From an OpenAI request to engine requests and back: validation against the server's
limits, ``SamplingParams``, prompts (chat templates included), logprobs, usage, and the
streamed and non-streamed answers of both endpoints."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from kiln.errors import ConfigError, EngineDeadError
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams
from kiln.serve import sse
from kiln.serve.config import ServeConfig
from kiln.serve.errors import APIError, from_config_error
from kiln.serve.metrics import ServerMetrics
from kiln.serve.protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from kiln.serve.responses import Job, LogprobFormatter, reason_of, usage_of, without_generated

log = logging.getLogger("kiln.serve")
UNSUPPORTED = ("tools", "tool_choice", "suffix", "parallel_tool_calls")


class Generation:
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
                ids = self.tok.encode(item)
                texts.append(item)
            else:
                ids = self._check_ids(list(item), "prompt")
                texts.append(self.fmt.decode(ids))
            prompts.append(self._check_ids(ids, "prompt"))
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
            prompt_logprobs=lp if (req.echo and lp is not None) else None,
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
        params = self._params(req, max_tokens=mt, logprobs=lp)
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
        )

    # ---- running -----------------------------------------------------------------------

    def admit(self, job: Job) -> list[AsyncIterator[RequestOutput]]:
        """Check the engine and the queue bound, validate against the KV cache, and return
        one engine stream per prompt (not started yet)."""
        llm = self.llm
        if llm.dead is not None:
            raise APIError(503, f"the engine is not available: {llm.dead}", code="engine_dead")
        waiting = llm.stats().num_waiting
        if waiting + len(job.prompts) > self.config.max_queued_requests:
            raise APIError(
                429,
                f"the server's queue is full ({waiting} requests waiting, at most "
                f"{self.config.max_queued_requests}); retry later.",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        streams = []
        for i, ids in enumerate(job.prompts):
            try:  # the engine's own checks (KV-cache fit) before anything is sent
                llm.core.make_request(ids, job.params, f"{job.rid}-{i}")
            except ConfigError as e:
                raise from_config_error(e) from None
            streams.append(llm.generate_async(ids, job.params, f"{job.rid}-{i}"))
        return streams

    def _finish(self, out: RequestOutput, reason: str | None = None) -> None:
        self.metrics.observe(out, time.monotonic(), reason)

    async def run(self, job: Job) -> dict[str, Any]:
        """The whole answer of a non-streamed request."""
        final: dict[int, RequestOutput] = {}
        last: dict[int, RequestOutput] = {}
        streams = self.admit(job)
        try:
            async for i, out in sse.merge(streams):
                last[i] = out
                if out.finished:
                    final[i] = out
                    self._finish(out)
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not available: {e}", code="engine_dead") from None
        except APIError:
            raise
        except Exception as e:
            log.error("request %s failed: %s: %s", job.rid, type(e).__name__, e)
            raise APIError(
                500, f"the engine failed this request ({type(e).__name__}: {e})."
            ) from None
        finally:
            for i, out in last.items():
                if i not in final:
                    self._finish(out, "abort")
        for out in final.values():
            if out.error:
                raise APIError(500, f"the engine failed this request: {out.error}.")
        outs = [final[i] for i in range(len(job.prompts))]
        if job.echo_only:
            outs = [without_generated(o) for o in outs]
        choices = []
        for i, out in enumerate(outs):
            for o in out.outputs:
                choices.append(self._choice(job, i, out, o))
        return {
            "id": job.rid,
            "object": "text_completion" if job.kind == "completion" else "chat.completion",
            "created": now(),
            "model": self.config.model_name,
            "choices": choices,
            "usage": usage_of(outs),
        }

    def _choice(self, job: Job, i: int, out: RequestOutput, o: Any) -> dict[str, Any]:
        index = i * job.n + o.index
        if job.kind == "chat":
            lp = self.fmt.chat(o.logprobs, job.logprobs) if job.logprobs is not None else None
            return {
                "index": index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": lp,
                "finish_reason": reason_of(o.finish_reason),
                "stop_reason": o.stop_reason,
            }
        text, lps = o.text, None
        if job.echo:
            text = job.texts[i] + text
        if job.logprobs is not None:
            entries = list(o.logprobs or [])
            ptoks: list[int] = []
            if job.echo:
                entries = list(out.prompt_logprobs or [None]) + entries
                ptoks = out.prompt_token_ids
            lps = self.fmt.completion(ptoks + o.token_ids, entries, job.logprobs, 0)
        return {
            "index": index,
            "text": text,
            "logprobs": lps,
            "finish_reason": reason_of(o.finish_reason),
            "stop_reason": o.stop_reason,
        }

    async def stream(
        self, job: Job, streams: list[AsyncIterator[RequestOutput]]
    ) -> AsyncIterator[bytes]:
        """SSE frames of a streamed request; always ends with ``data: [DONE]``, after an error
        event when the engine fails."""
        chat = job.kind == "chat"
        base = {
            "id": job.rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": now(),
            "model": self.config.model_name,
        }
        if job.include_usage:
            base["usage"] = None
        sent_text: dict[int, int] = {}
        sent_toks: dict[int, int] = {}
        done: set[int] = set()
        last: dict[int, RequestOutput] = {}
        finished: set[int] = set()
        try:
            if chat:
                for k in range(job.n):
                    choice = {"index": k, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}  # fmt: skip
                    yield sse.event({**base, "choices": [choice]})
            async for i, out in sse.merge(streams):
                last[i] = out
                if out.finished:
                    finished.add(i)
                    self._finish(out)
                    if out.error:
                        raise RuntimeError(out.error)
                if job.echo_only:
                    last[i] = out = without_generated(out)
                for o in out.outputs:
                    index = i * job.n + o.index
                    if index in done:
                        continue
                    if index not in sent_text and not chat and job.echo:
                        yield sse.event({**base, "choices": [self._echo_chunk(job, i, out, index)]})
                    a, b = sent_text.get(index, 0), sent_toks.get(index, 0)
                    delta, toks = o.text[a:], o.token_ids[b:]
                    sent_text[index], sent_toks[index] = len(o.text), len(o.token_ids)
                    reason = reason_of(o.finish_reason)
                    if not delta and not toks and reason is None:
                        continue
                    lp = None
                    if job.logprobs is not None and toks:
                        entries = (o.logprobs or [])[b:]
                        lp = (
                            self.fmt.chat(entries, job.logprobs)
                            if chat
                            else self.fmt.completion(toks, entries, job.logprobs, a)
                        )
                    if reason is not None:
                        done.add(index)
                    if chat:
                        choice = {"index": index, "delta": {"content": delta} if delta else {},
                                  "logprobs": lp, "finish_reason": reason}  # fmt: skip
                    else:
                        choice = {"index": index, "text": delta, "logprobs": lp,
                                  "finish_reason": reason}  # fmt: skip
                    if reason is not None:
                        choice["stop_reason"] = o.stop_reason
                    yield sse.event({**base, "choices": [choice]})
            if job.include_usage:
                outs = [last[i] for i in sorted(last)]
                yield sse.event({**base, "choices": [], "usage": usage_of(outs)})
        except Exception as e:
            log.error("stream %s failed: %s: %s", job.rid, type(e).__name__, e)
            status = 503 if isinstance(e, EngineDeadError) else 500
            err = APIError(status, f"the engine failed this request ({type(e).__name__}: {e}).")
            yield sse.event(err.body())
        finally:
            for i, out in last.items():
                if i not in finished:
                    self._finish(out, "abort")
            for i in range(len(streams)):
                self.llm.abort(f"{job.rid}-{i}")  # no-op for finished requests
        yield sse.DONE

    def _echo_chunk(self, job: Job, i: int, out: RequestOutput, index: int) -> dict[str, Any]:
        lp = None
        if job.logprobs is not None:
            lp = self.fmt.completion(
                out.prompt_token_ids, list(out.prompt_logprobs or [None]), job.logprobs, 0
            )
        return {"index": index, "text": job.texts[i], "logprobs": lp, "finish_reason": None}
