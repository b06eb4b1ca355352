"""Folding AWQ's smoothing factors into whatever produces each projection's input, as
AutoAWQ's checkpoints do, so that no int4 projection divides its input at run time.

A projection quantized from W * s computes (x / s) @ Q(W * s)^T. Dividing x by s costs the
weight-only kernel a load and a multiply per input element, in every decode step. Instead,
per decoder layer:

- ``attn.qkv``, ``mlp.gate_up``: the RMSNorm weight before them is divided by s;
- ``mlp.down``: the up rows of ``gate_up`` (silu(gate) * up is linear in up) are divided by
  s, through their row scales when ``gate_up`` is quantized (exact for the per-row and
  per-(row, group) scales of kiln's formats) or their weights when it is not;
- ``attn.o``: the v rows of ``qkv`` likewise, when s is the same for every query head that
  shares a key-value head (``tie_heads`` makes AWQ's search give such factors); otherwise o
  keeps dividing at run time.

The projection's factors then become ones, which ``QuantLinear`` skips. Up to the rounding
of the scaled norm weights to the model's dtype, and of scaled int4 row scales back onto
float16's grid where they were on it (2**-12 of each at most; ``formats.f16_grid_up``), the
model computes the same function."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kiln.quant import formats as qf
from kiln.quant.layers import QuantLinear
from kiln.quant.stats import InputStats


def tie_heads(stats: InputStats, num_heads: int, num_kv_heads: int) -> InputStats:
    """``attn.o``'s input statistics with the mean |x| of every channel averaged over the
    query heads that share a key-value head, so that AWQ factors searched from it can be
    folded into the v rows."""
    rep = num_heads // num_kv_heads
    a = stats.mean_abs.reshape(num_kv_heads, rep, -1)
    tied = a.mean(1, keepdim=True).expand_as(a).reshape(-1).contiguous()
    return dataclasses.replace(stats, mean_abs=tied)


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set a parameter or buffer to a new tensor: the old one may be shared (a build's
    model holds the converted state dict's tensors, which the quality gate's unquantized
    reference reuses), so nothing is changed in place."""
    if name in module._parameters:
        setattr(module, name, nn.Parameter(value, requires_grad=False))
    else:
        setattr(module, name, value)


@torch.no_grad()
def _scale_rows(producer: nn.Module, start: int, f: torch.Tensor) -> None:
    """Multiply output rows ``start .. start + len(f)`` of a Linear or QuantLinear by ``f``."""
    name = "weight_scale" if isinstance(producer, QuantLinear) else "weight"
    names = (name, "bias") if producer.bias is not None else (name,)
    rows = slice(start, start + f.numel())
    for n in names:
        t = getattr(producer, n)
        new = t.detach().clone()
        g = f.to(t.device, torch.float32)
        new[rows] = (t[rows].float() * (g[:, None] if t.dim() == 2 else g)).to(t.dtype)
        if n == "weight_scale" and producer.algo == "int4-awq" and qf.on_f16_grid(t):
            # kept on float16's grid (formats.int4_fit): each rounded to the nearest there
            new[rows] = new[rows].clamp(qf.F16_TINY, qf.F16_MAX).half().to(t.dtype)
        _replace(producer, n, new)


@torch.no_grad()
def _fold_into_norm(norm: nn.Module, q: QuantLinear) -> None:
    w = norm.weight
    _replace(norm, "weight", (w.float() / q.smooth.to(w.device)).to(w.dtype))


def _done(q: QuantLinear) -> None:
    _replace(q, "smooth", torch.ones_like(q.smooth))
    q.refresh_smooth()


@torch.no_grad()
def fold_smoothing(model: nn.Module, o: bool = True) -> list[str]:
    """Fold every foldable projection's smoothing factors (see the module docstring) in
    place; the names of the projections folded. ``o=False`` leaves ``attn.o``'s, whose fold
    changes v and so the values an fp8 cache's calibrated scales were measured on (loading
    engines built before folding existed)."""
    done = []
    for i, layer in enumerate(getattr(model, "layers", [])):
        attn, mlp = layer.attn, layer.mlp
        for norm, q, name in ((layer.attn_norm, attn.qkv, "attn.qkv"),
                              (layer.mlp_norm, mlp.gate_up, "mlp.gate_up")):  # fmt: skip
            if isinstance(q, QuantLinear) and q.smooth_active:
                _fold_into_norm(norm, q)
                _done(q)
                done.append(f"layers.{i}.{name}")
        down = mlp.down
        if isinstance(down, QuantLinear) and down.smooth_active:
            _scale_rows(mlp.gate_up, down.in_features, 1.0 / down.smooth)  # the up rows
            _done(down)
            done.append(f"layers.{i}.mlp.down")
        o_proj = attn.o
        if o and isinstance(o_proj, QuantLinear) and o_proj.smooth_active:
            rep = attn.num_heads // attn.num_kv_heads
            s = o_proj.smooth.reshape(attn.num_kv_heads, rep, attn.head_dim)
            if bool((s == s[:, :1]).all()):  # the same factor for every head of a group
                v0 = attn.q_size + attn.kv_size  # the v rows
                _scale_rows(attn.qkv, v0, 1.0 / s[:, 0].reshape(-1))
                _done(o_proj)
                done.append(f"layers.{i}.attn.o")
    return done
