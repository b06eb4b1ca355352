"""Which quantized projections cost most: output error weighted by the loss's sensitivity
to each output channel (a diagonal-Fisher estimate, as TensorRT Model Optimizer's
auto-quantize uses), instead of relative output error alone, which ranks projections
whose errors the rest of the network never notices (``attn.o`` on SmolLM2) above the one
that matters (the last ``mlp.down``, whose output dominates the final hidden state).

For a projection with outputs y, the expected increase of the mean next-token loss (nats
per token) from a small output error dy is about 1/2 * sum_j F_j * E[dy_j^2], with F_j the
empirical Fisher information of output channel j: the mean over tokens of (dS/dy_j)^2, S
the summed next-token loss of a window. ``output_grad_sq`` measures F with one backward pass
per calibration window through the unquantized model (torch references on every device:
the Triton kernels have no backward); ``sensitivity`` turns it and sampled output errors
into the estimate, and 100 * (exp(estimate) - 1) is the perplexity increase in % it
predicts for that projection alone."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.kernels._triton import reference_kernels
from kiln.quant.stats import _param, forward_sequence

SENSITIVITY_TOKENS = 1024
"""Calibration tokens the backward passes cover (the first windows)."""


def output_grad_sq(
    model: nn.Module, windows: list[list[int]], modules: dict[str, nn.Module]
) -> tuple[dict[str, torch.Tensor], int]:
    """(mean over tokens of (dS/dy)^2 per output channel of each module in ``modules``, as
    float32 (out_features,) tensors; the number of tokens), S the summed next-token loss of
    each window of ``windows`` (run as its own sequence). The model's parameters are left
    as they were (no gradients kept)."""
    dev = _param(model).device
    grads = {n: torch.zeros(m.out_features, device=dev) for n, m in modules.items()}

    def hook_for(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
            def accumulate(g: torch.Tensor) -> None:  # returns None: g itself is kept
                grads[name].add_(g.float().pow(2).sum(0))

            if out.requires_grad:
                out.register_hook(accumulate)

        return hook

    def track(_m: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out.detach().requires_grad_(True)  # the graph starts at the embeddings

    params = list(model.parameters())
    was = [p.requires_grad for p in params]
    handles = [m.register_forward_hook(hook_for(n)) for n, m in modules.items()]
    handles.append(model.embed.register_forward_hook(track))
    tokens = 0
    try:
        for p in params:
            p.requires_grad_(False)
        with torch.inference_mode(False), torch.enable_grad(), reference_kernels():
            for w in windows:
                if len(w) < 2:
                    continue
                logits = model.compute_logits(forward_sequence(model, w)[:-1]).float()
                labels = torch.tensor(w[1:], dtype=torch.long, device=dev)
                F.cross_entropy(logits, labels, reduction="sum").backward()
                tokens += len(w) - 1
    finally:
        for h in handles:
            h.remove()
        for p, r in zip(params, was, strict=True):
            p.requires_grad_(r)
    return {n: g / max(tokens, 1) for n, g in grads.items()}, tokens


def sensitivity(grad_sq: torch.Tensor, dy: torch.Tensor) -> float:
    """Estimated increase of the mean next-token loss (nats per token) from output errors
    ``dy`` (samples, out_features) of one projection with Fisher ``grad_sq`` (from
    ``output_grad_sq``): 1/2 * sum_j grad_sq_j * mean dy_j^2."""
    return 0.5 * float((grad_sq.to(dy.device) * dy.float().pow(2).mean(0)).sum())
