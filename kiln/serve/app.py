"""``create_app``: the FastAPI app of ``kiln serve`` and its routes.

The engine loads in a worker thread after the app starts, so ``/health`` answers 503
(``loading``) until it is ready; ``/v1`` routes answer 503 meanwhile."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import kiln
from kiln.serve import sse
from kiln.serve.config import ServeConfig
from kiln.serve.errors import APIError, install_handlers
from kiln.serve.faults import install_fault_injection
from kiln.serve.generation import Generation
from kiln.serve.guard import Guard
from kiln.serve.metrics import CONTENT_TYPE, ServerMetrics
from kiln.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)

log = logging.getLogger("kiln.serve")

ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse, "description": d}
    for s, d in (
        (400, "invalid request"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "body too large"),
        (415, "not JSON"),
        (429, "queue full"),
        (503, "loading, draining or engine failed"),
    )
}


class ServerState:
    """What the routes share: the engine once loaded, and the server's condition."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.llm: Any = None
        self.gen: Generation | None = None
        self.load_error: str | None = None
        self.draining = False
        self.started = int(time.time())
        self.metrics = ServerMetrics(lambda: self.llm)

    def generation(self) -> Generation:
        if self.gen is None:
            why = self.load_error or "the model is still loading"
            raise APIError(503, f"the server is not ready: {why}.", code="not_ready")
        return self.gen


def load_llm(config: ServeConfig) -> Any:
    """``create_app``'s default engine: ``kiln.LLM(config.model, **config.llm_kwargs())``."""
    from kiln.llm import LLM

    return LLM(config.model, progress=False, **config.llm_kwargs())


def create_app(
    config: ServeConfig,
    llm_factory: Callable[[], Any] | None = None,
    on_load_failed: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app for ``config``. ``llm_factory`` builds the engine (default: ``load_llm``);
    it runs in a worker thread."""
    state = ServerState(config)

    def build() -> Any:
        return llm_factory() if llm_factory is not None else load_llm(config)

    async def load() -> None:
        t0 = time.perf_counter()
        try:
            llm = await asyncio.to_thread(build)
        except Exception as e:
            state.load_error = f"{type(e).__name__}: {e}"
            log.error("loading the model failed: %s", state.load_error)
            if on_load_failed is not None:
                on_load_failed(state.load_error)
            return
        install_fault_injection(llm)
        state.llm = llm
        state.gen = Generation(llm, config, state.metrics)
        log.info("model %s ready in %.1f s", config.model_name, time.perf_counter() - t0)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(load())
        yield
        state.draining = True
        if not task.done():
            task.cancel()

    app = FastAPI(
        title="kiln",
        version=kiln.__version__,
        description="OpenAI-compatible text generation served by kiln.",
        lifespan=lifespan,
    )
    app.state.kiln = state
    install_handlers(app)
    app.add_middleware(
        Guard,
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        max_header_count=config.max_header_count,
        max_header_bytes=config.max_header_bytes,
        draining=lambda: state.draining,
    )

    @app.get("/health", responses={503: {"description": "loading, draining or engine failed"}})
    async def health() -> Response:
        llm = state.llm
        body: dict[str, Any] = {"status": "ok"}
        if state.load_error is not None:
            body = {"status": "failed", "error": state.load_error}
        elif llm is None:
            body = {"status": "loading"}
        elif llm.dead is not None:
            body = {"status": "dead", "error": llm.dead}
        elif state.draining:
            body = {"status": "draining"}
        if llm is not None:
            body["engine_step_failures"] = llm.step_failures
            body["last_engine_error"] = llm.last_step_error
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kiln.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> dict[str, Any]:
        llm = state.llm
        card = ModelCard(
            id=config.model_name,
            created=state.started,
            max_model_len=state.gen.max_model_len if state.gen is not None else None,
        )
        del llm
        return {"object": "list", "data": [card.model_dump()]}

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gen = state.generation()
        return await _answer(gen, gen.completion_job(body))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gen = state.generation()
        return await _answer(gen, gen.chat_job(body))

    return app


async def _answer(gen: Generation, job: Any) -> Response:
    if job.stream:
        streams = gen.admit(job)
        return StreamingResponse(
            gen.stream(job, streams), media_type="text/event-stream", headers=sse.HEADERS
        )
    return JSONResponse(await gen.run(job))
