"""From an OpenAI request to engine requests and back: validation (``kiln.serve.jobs``),
admission, logprobs, usage, and the streamed and non-streamed answers of both endpoints."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from kiln.errors import ConfigError, EngineDeadError
from kiln.outputs import RequestOutput
from kiln.serve import sse
from kiln.serve.errors import APIError, from_config_error
from kiln.serve.jobs import JobBuilder
from kiln.serve.protocol import now
from kiln.serve.responses import Job, reason_of, usage_of, without_generated

log = logging.getLogger("kiln.serve")


class Generation(JobBuilder):
    """Running ``Job``s on the engine: admission, and the streamed and non-streamed answers."""

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
        body = {
            "id": job.rid,
            "object": "text_completion" if job.kind == "completion" else "chat.completion",
            "created": now(),
            "model": self.config.model_name,
            "choices": choices,
            "usage": usage_of(outs),
        }
        if job.kind == "chat" and job.prompt_logprobs is not None:  # vLLM: the response's
            o = outs[0]
            body["prompt_logprobs"] = self.fmt.prompt(
                o.prompt_token_ids, o.prompt_logprobs, job.prompt_logprobs
            )
        return body

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
        choice = {
            "index": index,
            "text": text,
            "logprobs": lps,
            "finish_reason": reason_of(o.finish_reason),
            "stop_reason": o.stop_reason,
        }
        if job.prompt_logprobs is not None:  # vLLM: each choice's
            choice["prompt_logprobs"] = self.fmt.prompt(
                out.prompt_token_ids, out.prompt_logprobs, job.prompt_logprobs
            )
        return choice

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
