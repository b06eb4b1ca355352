"""``--auto-exclude N``: when a build's quality gate fails, keep its costliest projections in
full precision, one at a time, until the loss fits ``--max-quality-loss``.

The projections are taken in the order of the gate's own ranking (the estimated perplexity
increase each would cause alone, ``kiln.quant.sensitivity``), at most N of them; after
each one the held-out perplexity is measured again, so the engine's recorded quality is
the measured one. A projection kept this way gets its unquantized weights back in the
model and in the state the engine is written from, and the manifest lists it under
``quant.auto_excluded`` (with the loss measured after it) and ``quant.exclude_modules``.

Only modes whose projections are quantized independently of each other qualify: int4-awq
folds each projection's AWQ factors into its neighbours, so one cannot be restored alone
(its builds take ``--exclude-modules`` instead, which quantizes around the exclusions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def ranked_projections(report: dict[str, dict[str, Any]]) -> list[str]:
    """The quantized projections of a ``quantize_model`` report with measured errors, the
    costliest first (estimated perplexity increase, then relative output error)."""
    scored = [
        (n, e.get("est_ppl_increase_pct", 0.0), e["rel_output_error"])
        for n, e in report.items()
        if e.get("mode", "none") != "none" and "rel_output_error" in e
    ]
    return [n for n, _, _ in sorted(scored, key=lambda t: (-t[1], -t[2]))]


def restore_projection(
    qmodel: nn.Module,
    qstate: dict[str, torch.Tensor],
    ref_model: nn.Module,
    state: dict[str, torch.Tensor],
    name: str,
) -> None:
    """Put projection ``name`` of the unquantized ``ref_model`` (weights ``state``) back
    into the quantized ``qmodel`` and its engine state ``qstate`` (both changed in place)."""
    parent, _, attr = name.rpartition(".")
    setattr(qmodel.get_submodule(parent), attr, ref_model.get_submodule(name))
    prefix = name + "."
    for k in [k for k in qstate if k.startswith(prefix)]:
        del qstate[k]
    for k, v in state.items():
        if k.startswith(prefix):
            qstate[k] = v.detach().to("cpu").contiguous()


def keep_costliest(
    qmodel: nn.Module,
    qstate: dict[str, torch.Tensor],
    ref_model: nn.Module,
    state: dict[str, torch.Tensor],
    report: dict[str, dict[str, Any]],
    limit: float,
    most: int,
    measure: Callable[[], dict[str, Any]],
    quality: dict[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Restore the costliest projections one at a time while ``quality`` (the gate's result
    for ``qmodel`` as it is) exceeds ``limit`` percent, at most ``most`` of them; the last
    quality measured and the steps taken. ``measure()`` scores ``qmodel`` again. The
    report's entries of restored projections become mode "none", unquantized size."""
    steps: list[dict[str, Any]] = []
    for name in ranked_projections(report)[:most]:
        if quality["ppl_increase_pct"] <= limit:
            break
        restore_projection(qmodel, qstate, ref_model, state, name)
        entry = report[name]
        est = entry.get("est_ppl_increase_pct")
        entry.update(mode="none", auto_excluded=True, bytes_after=entry["bytes_before"])
        quality = measure()
        steps.append(
            {
                "module": name,
                "est_ppl_increase_pct": est,
                "ppl_increase_pct_after": quality["ppl_increase_pct"],
            }
        )
    return quality, steps
