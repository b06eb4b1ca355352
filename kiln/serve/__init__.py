"""``kiln serve``: an OpenAI-compatible HTTP server over ``kiln.LLM``.

``config`` (ServeConfig from flags and YAML), ``protocol`` (request and response models),
``guard`` (size, type, encoding and auth checks before any route), ``generation``
(requests to engine calls and answers), ``sse`` (event stream framing), ``metrics``
(Prometheus, ``kiln:*``), ``errors`` (OpenAI's error shape), ``faults`` (test hook),
``app`` (the FastAPI app), ``server`` (uvicorn with a graceful drain)."""

from __future__ import annotations

from kiln.serve.config import ServeConfig, make_config

__all__ = ["ServeConfig", "make_config"]
