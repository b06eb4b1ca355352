"""Run the app under uvicorn with a graceful drain: on SIGTERM (or SIGINT) the server stops
accepting connections, answers 503 to new requests on open ones, lets the requests in flight
finish for up to ``shutdown_timeout`` seconds, then cancels what is left and exits 0."""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any

import uvicorn

from kiln.runtime import heap
from kiln.serve.app import create_app, load_llm
from kiln.serve.config import ServeConfig

log = logging.getLogger("kiln.serve")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Any) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)
        # a drained shutdown is a normal exit: do not re-raise the signal afterwards
        self._captured_signals.clear()


def h11_header_bound(max_header_bytes: int) -> int:
    """h11's own bound on a header block still arriving. It sits well above
    ``max_header_bytes`` so that a block over the limit is read whole and answered by the
    Guard with a 431 in OpenAI's error shape, however the network splits it: at the limit
    itself h11 would fail a block that arrived in pieces, uvicorn would answer a plain 400
    and close with bytes unread, and the client could see a reset instead of an answer.
    Only header blocks past this bound still get that treatment."""
    return max(256 * 1024, 4 * max_header_bytes)


def load_frozen(config: ServeConfig) -> Any:
    """The served engine (``load_llm``), then the process's heap frozen out of the garbage
    collector's scans for the server's life (``kiln.runtime.heap``)."""
    llm = load_llm(config)
    log.info("%d objects frozen out of the garbage collector's scans", heap.freeze())
    return llm


def run(config: ServeConfig) -> int:
    """Serve until a signal; returns the process exit code."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    failed: list[str] = []
    server: _Server | None = None

    def load_failed(why: str) -> None:
        failed.append(why)
        if server is not None:
            server.should_exit = True

    app = create_app(config, llm_factory=lambda: load_frozen(config), on_load_failed=load_failed)
    state = app.state.kiln

    def drain() -> None:
        if not state.draining:
            log.info("draining: refusing new requests, %.0f s for those in flight",
                     config.shutdown_timeout)  # fmt: skip
        state.draining = True

    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=int(config.shutdown_timeout + 0.999),
        h11_max_incomplete_event_size=h11_header_bound(config.max_header_bytes),
        timeout_keep_alive=5,
        server_header=False,
        access_log=config.log_level == "debug",
    )
    server = _Server(uv, drain)
    log.info("kiln serve on http://%s:%d (model %s)", config.host, config.port, config.model_name)
    server.run()
    if failed:
        print(f"kiln serve: error: {failed[0]}", file=sys.stderr)
        return 2
    return 0
