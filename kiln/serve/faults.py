"""A test hook: ``KILN_FAULT_INJECT`` makes the engine step raise, to test that a failing
engine fails the affected requests, not the server.

``KILN_FAULT_INJECT=step:N`` makes the N-th engine step (1-based, counted from the server's
start) raise ``InjectedFault`` once; ``step:N+`` makes every step from the N-th on raise, so
the engine cannot recover (``/health`` then answers 503). Unset, nothing is changed."""

from __future__ import annotations

import logging
import os
from typing import Any

from kiln.errors import ConfigError

ENV = "KILN_FAULT_INJECT"
log = logging.getLogger("kiln.serve")


class InjectedFault(RuntimeError):
    """Raised by an engine step on purpose (``KILN_FAULT_INJECT``)."""


def parse(spec: str) -> tuple[int, bool]:
    """``"step:N"`` -> (N, False); ``"step:N+"`` -> (N, True)."""
    kind, _, rest = spec.partition(":")
    forever = rest.endswith("+")
    num = rest.removesuffix("+")
    if kind != "step" or not num.isdigit() or int(num) < 1:
        raise ConfigError(f"{ENV}={spec!r} is invalid: step:N or step:N+ with N >= 1.")
    return int(num), forever


def install_fault_injection(llm: Any, spec: str | None = None) -> None:
    """Wrap ``llm.core.step`` as ``$KILN_FAULT_INJECT`` (or ``spec``) asks."""
    spec = spec if spec is not None else os.environ.get(ENV)
    if not spec:
        return
    at, forever = parse(spec)
    core = llm.core
    step = core.step
    count = 0

    def faulty_step() -> Any:
        nonlocal count
        count += 1
        if count == at or (forever and count > at):
            raise InjectedFault(f"injected fault at engine step {count} ({ENV}={spec})")
        return step()

    core.step = faulty_step
    log.warning(
        "%s=%s: engine step %d%s will raise", ENV, spec, at, " and later" if forever else ""
    )
