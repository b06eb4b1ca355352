"""``kiln bench throughput --cases``: several synthetic shapes measured on one loaded engine.

A case is ``REQUESTSxISLxOSL`` with an optional ``@CONCURRENCY`` cap, e.g. TensorRT-LLM's
four H200 shapes as ``10000x128x128@2048,1000x2048x128@2048,1000x1000x1000@1024,
800x128x2048@1024``. Each case runs as a separate ``kiln bench throughput`` would after its
load: the prefix cache is emptied first (so no case finds an earlier one's prompts), then
``--warmup`` requests, then the timed requests, and a report of its own. What the cases
share is the load itself: the weights, the KV cache, the compiled kernels and the CUDA
graphs, so a sweep skips every load after the first."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from kiln.errors import ConfigError, bad_value

_CASE = re.compile(r"(\d+)x(\d+)x(\d+)(?:@(\d+))?")
CASE_HELP = (
    "cases like 1000x2048x128 (requests x input tokens x output tokens) or 1000x2048x128@2048 "
    "(at most 2048 in flight), comma-separated"
)
# the options a case replaces, and those that describe another kind of dataset
_REPLACED = ("num_requests", "isl", "osl", "concurrency")
_OTHER_DATA = ("dataset", "prompts_file", "save_dataset", "peer")


@dataclass(frozen=True)
class Case:
    """One shape of a sweep."""

    num_requests: int
    isl: int
    osl: int
    concurrency: int | None = None

    @property
    def spec(self) -> str:
        """As written on the command line."""
        cap = f"@{self.concurrency}" if self.concurrency else ""
        return f"{self.num_requests}x{self.isl}x{self.osl}{cap}"

    @property
    def file_part(self) -> str:
        """What ``{case}`` in a report path becomes: isl-osl-requests[-cN]."""
        cap = f"-c{self.concurrency}" if self.concurrency else ""
        return f"{self.isl}-{self.osl}-{self.num_requests}{cap}"


def parse_cases(spec: str) -> list[Case]:
    """``--cases``' value as cases, in order; a malformed or zero entry is refused naming it."""
    items = [s.strip() for s in spec.split(",")]
    if not any(items):
        raise bad_value("--cases", spec, CASE_HELP)
    cases = []
    for item in items:
        m = _CASE.fullmatch(item)
        if m is None:
            raise bad_value("--cases", item, CASE_HELP)
        n, isl, osl = (int(g) for g in m.groups()[:3])
        cap = int(m.group(4)) if m.group(4) is not None else None
        if min(n, isl, osl) < 1 or cap == 0:
            raise bad_value("--cases", item, "requests, tokens and concurrency of at least 1")
        cases.append(Case(n, isl, osl, cap))
    return cases


def check_options(a: argparse.Namespace, cases: list[Case]) -> None:
    """Refuse options that a sweep would otherwise ignore or overwrite, naming them."""
    for name in _REPLACED:
        if getattr(a, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"{flag} cannot be combined with --cases: each case gives its own requests, "
                "lengths and concurrency (e.g. --cases 1000x2048x128@2048)."
            )
    for name in _OTHER_DATA:
        if getattr(a, name):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"{flag} cannot be combined with --cases, whose cases are synthetic prompts; "
                f"run {flag} in a benchmark of its own."
            )
    path = a.report_json
    if path and len(cases) > 1:
        if "{case}" not in path:
            raise bad_value(
                "--report-json", path,
                f"with {len(cases)} cases, a path containing {{case}}, which each case's "
                "isl-osl-requests[-cN] replaces (e.g. out/throughput-{case}.json)",
            )  # fmt: skip
        seen = [c.file_part for c in cases]
        if len(set(seen)) < len(seen):
            raise bad_value(
                "--cases", a.cases, "each case once when --report-json is written (two would "
                "write one file)",
            )  # fmt: skip


def check_fits(cases: list[Case], max_seq_len: int) -> None:
    """Refuse, before any case runs, a case longer than the engine's ``max_seq_len``."""
    for c in cases:
        if c.isl + c.osl > max_seq_len:
            raise bad_value(
                "--cases", c.spec, f"input + output tokens of at most the engine's max_seq_len "
                f"({max_seq_len}; rebuild with a larger --max-seq-len)",
            )  # fmt: skip


def report_path(template: str | None, case: Case) -> str | None:
    """Where ``case``'s report goes (None: nowhere)."""
    return template.replace("{case}", case.file_part) if template else None
