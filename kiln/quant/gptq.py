"""GPTQ weight rounding (Frantar et al., 2022) for the fp8 and int4 formats.

Round-to-nearest rounds every weight on its own. GPTQ rounds the columns of a weight
(N, K) one at a time and spreads each column's rounding error over the columns not yet
rounded, weighted by the inverse of the input Hessian H = E[x^T x] (K, K) from calibration,
so that the layer's output error on the calibration inputs, not the weight error, is what
gets minimised. The storage layout does not change: the result is the same (weight, scale,
zero) a round-to-nearest quantizer produces, only with other rounding decisions.

- fp8: one scale per output row, ``amax / 448`` of the row as given (the same scale as
  round-to-nearest); every column is rounded to e4m3 with it.
- int4: asymmetric uint4 groups of ``group_size`` along K; each group's scale and zero
  point are fitted (``fit_int4_group``: ``formats.quantize_int4``'s range, shrunk where
  that lowers the group's Hessian-weighted rounding error) to the group's weights as given
  ("static groups"), since by default the columns are rounded in order of decreasing
  Hessian diagonal ("act order"), across groups; in order (``act_order=False``, fp8's
  default) each group is fitted when
  GPTQ reaches its first column, after the error of the groups before it has been spread
  into it (the reference implementation's default). Groups stay contiguous along K either
  way, so the kernels and the checkpoint layout are unchanged.

H is accumulated in float32 on the model's device, a few modules at a time so that at most
``HESSIAN_BUDGET_BYTES`` of Hessians are alive at once (one calibration pass per batch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kiln.quant import formats as qf
from kiln.quant.stats import decoder_linears, run_with_input_hooks

GPTQ_DAMP = 0.01
"""Dampening added to H's diagonal: this fraction of its mean (the reference default)."""
GPTQ_BLOCK = 128
"""Columns rounded per lazy-update block (for int4, rounded to whole groups)."""
ACT_ORDER = {"fp8": False, "int4": True}
"""Whether a build rounds columns in order of decreasing Hessian diagonal (with static int4
groups; see ``gptq_round``), by measurement on SmolLM2 (docs/quantization.md): int4-awq g64
mean KL 0.084 with it against 0.097 without on 2,044 held-out tokens (perplexity +7.95 %
against +9.89 %) and 0.108 against 0.120 on 16,352 (+10.28 % against +10.29 %); fp8
+1.53 % against +1.34 % (KL 0.0166 against 0.0186: no clear gain), so fp8 keeps the plain
order."""
CLIP_RATIOS: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
"""Shrink factors of an int4 group's [min, max] range that ``fit_int4_group`` tries (1.0:
the full range, no clipping), AWQ's and the GPTQ reference's clip search. By measurement on
SmolLM2 int4-awq g64, 16,352 held-out tokens: +5.52 % perplexity, mean KL 0.064 with it
against +6.05 %, 0.069 without (16,384 calibration tokens); +5.30 %, 0.073 against +7.80 %,
0.076 (8,192); +7.64 %, 0.101 against +10.28 %, 0.108 (2,048) (docs/quantization.md)."""
HESSIAN_BUDGET_BYTES = 2 << 30
"""Most bytes of Hessians alive at once while collecting them."""

Fit = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


@torch.inference_mode()
def collect_hessians(
    model: nn.Module,
    windows: list[list[int]],
    modules: list[str],
    head: str | None = None,
) -> dict[str, torch.Tensor]:
    """H = mean over every input row x (1, K) of x^T x, (K, K) float32 on the model's device,
    of each decoder Linear named in ``modules``, over ``windows`` (token id lists, each run
    as its own sequence). With ``head`` also lm_head's input (the final hidden states,
    after the last norm) under that name, from the first pass: no pass of its own.
    Modules are batched into passes of at most ``HESSIAN_BUDGET_BYTES`` of Hessians."""
    if not windows:
        raise ValueError("no calibration windows")
    linears = decoder_linears(model)
    unknown = sorted(set(modules) - set(linears))
    if unknown:
        raise KeyError(f"not decoder Linears: {unknown}")
    dev = next(model.parameters()).device
    out: dict[str, torch.Tensor] = {}
    batch: list[str] = []
    final = head
    size = model.lm_head.dense_weight().shape[1] ** 2 * 4 if head else 0
    for i, name in enumerate(modules):
        batch.append(name)
        size += linears[name].in_features ** 2 * 4
        nxt = modules[i + 1] if i + 1 < len(modules) else None
        if nxt is None or size + linears[nxt].in_features ** 2 * 4 > HESSIAN_BUDGET_BYTES:
            out.update(_hessian_pass(model, windows, {n: linears[n] for n in batch}, dev, final))
            batch, final, size = [], None, 0
    if final:  # no decoder modules asked for
        out.update(_hessian_pass(model, windows, {}, dev, final))
    return out


def _hessian_pass(
    model: nn.Module,
    windows: list[list[int]],
    mods: dict[str, nn.Module],
    dev: torch.device,
    final: str | None = None,
) -> dict[str, torch.Tensor]:
    sizes = {n: m.in_features for n, m in mods.items()}
    if final:
        sizes[final] = model.lm_head.dense_weight().shape[1]
    h = {n: torch.zeros(k, k, device=dev) for n, k in sizes.items()}
    rows = dict.fromkeys(sizes, 0)

    def add(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        h[name].addmm_(x.T, x)
        rows[name] += x.shape[0]

    run_with_input_hooks(model, windows, mods, add, final)
    return {n: h[n] / max(rows[n], 1) for n in sizes}


def gptq_round(
    w: torch.Tensor,
    h: torch.Tensor,
    fit: Fit,
    group_size: int | None = None,
    act_order: bool = False,
) -> torch.Tensor:
    """GPTQ of ``w`` (N, K) with Hessian ``h`` (K, K): the dequantized (N, K) float32 weight.
    ``fit(w_group)`` is called with the (N, G) weights of each group of ``group_size``
    columns and returns the quantize-dequantize function of one column (N,) for that group
    (once, with all of ``w``, when ``group_size`` is None). Without ``act_order`` the
    columns are rounded in order and each group is fitted when it is reached (to its weights
    as updated so far); with it, the columns are rounded in order of decreasing H diagonal
    (the inputs with the most energy first, while the most columns remain to absorb their
    error) and every group is fitted up front to the weights as given ("static groups"), so
    that groups stay contiguous along K. A column whose input is always zero (zero H
    diagonal) is rounded as zero."""
    n, k = w.shape
    if group_size is not None and k % group_size and act_order:
        raise ValueError(f"group_size {group_size} must divide K={k} in act order")
    # in order (the last group may be ragged), a block holds whole groups: GPTQ_BLOCK
    # rounded down to a multiple of them
    block = GPTQ_BLOCK
    if group_size is not None and not act_order:
        block = max(GPTQ_BLOCK // group_size, 1) * group_size
    w = w.float().clone()
    h = h.to(w.device, torch.float32).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    qdq_of: list[Callable[[torch.Tensor], torch.Tensor]] = []
    if act_order:
        gs = group_size or k
        qdq_of = [fit(w[:, g0 : g0 + gs]) for g0 in range(0, k, gs)] if group_size else [fit(w)]
        perm = torch.argsort(torch.diag(h), descending=True, stable=True)
        group_of = (perm // gs).tolist()
        w, h = w[:, perm], h[perm][:, perm]
    h += GPTQ_DAMP * torch.mean(torch.diag(h)) * torch.eye(k, device=w.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.empty_like(w)
    qdq = fit(w) if group_size is None and not act_order else None
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        blk, err = w[:, b0:b1].clone(), torch.empty(n, b1 - b0, device=w.device)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            if act_order:
                qdq = qdq_of[group_of[b0 + i]]
            elif group_size is not None and (b0 + i) % group_size == 0:
                qdq = fit(blk[:, i : i + group_size])
            assert qdq is not None
            q = qdq(blk[:, i])
            out[:, b0 + i] = q
            e = (blk[:, i] - q) / hb[i, i]
            blk[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    if act_order:
        out = out[:, torch.argsort(perm)]
    return out


def gptq_fp8(
    w: torch.Tensor,
    h: torch.Tensor,
    act_order: bool = ACT_ORDER["fp8"],
    row_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (float8 (N, K), float32 scale (N,)): the layout of
    ``formats.quantize_fp8_weight`` (same row scales), GPTQ-rounded. ``row_amax`` (N,)
    replaces the rows' max |w| in the scales (fp8 outlier columns: zeroed in ``w``, they
    still need the scale to cover them)."""
    amax = w.float().abs().amax(dim=1) if row_amax is None else row_amax.float()
    scale = amax.reshape(-1, 1).clamp(min=1e-12) / qf.FP8_MAX
    s = scale.squeeze(1)
    deq = gptq_round(
        w, h, lambda _w: lambda col: qf.quantize_fp8(col, s).float() * s, act_order=act_order
    )
    return qf.quantize_fp8(deq, scale), s


def gptq_fp8_block(
    w: torch.Tensor, h: torch.Tensor, block: int = qf.FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (float8 (N, K), float32 tile scales (ceil(N / block), ceil(K / block))):
    the layout of ``formats.quantize_fp8_block_weight``, GPTQ-rounded in order. Each block
    of columns gets its tiles' scales when GPTQ reaches it, from the weights as updated so
    far (so the scales cover what the updates added); the last block may be ragged."""
    n, k = w.shape
    rb = -(-n // block)
    scales = torch.empty(rb, -(-k // block), device=w.device)
    at = [0]

    def fit(wg: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        a = torch.nn.functional.pad(wg.float().abs(), (0, 0, 0, rb * block - n))
        st = a.reshape(rb, -1).amax(dim=1).clamp(min=1e-12) / qf.FP8_MAX
        scales[:, at[0]] = st
        at[0] += 1
        rows = st.repeat_interleave(block)[:n]
        return lambda col: qf.quantize_fp8(col, rows).float() * rows

    deq = gptq_round(w, h, fit, block, act_order=False)
    return qf.quantize_fp8(deq, qf.block_scales_full(scales, n, k, block)), scales


def fit_int4_group(
    wg: torch.Tensor, h: torch.Tensor | None = None, ratios: tuple[float, ...] = (1.0,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (N,) float32 of one int4 group ``wg`` (N, G). Ratio 1.0 is
    ``formats.quantize_int4``'s fit (the range [min(w, 0), max(w, 0)]); each other ratio r
    shrinks that range to r times itself, clipping the outermost weights, and per row the
    ratio with the smallest rounding error is kept: d^T h d, d the row's error (G,), with
    ``h`` (G, G) the group's block of the input Hessian (the output error on the
    calibration inputs, as AWQ's clip search measures it), else d^T d. The first ratio wins
    ties, so with 1.0 first the result is never worse than no clipping."""
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise ValueError(f"clip ratios must be in (0, 1], got {ratios}")
    wg = wg.float()
    best_s = best_z = best_e = None
    for r in ratios:
        s, z = qf.int4_fit(wg, r)
        d = wg - qf.int4_qdq(wg, s[:, None], z[:, None])
        e = (d @ h.to(d) * d).sum(dim=1) if h is not None else d.pow(2).sum(dim=1)
        if best_e is None or best_s is None or best_z is None:
            best_s, best_z, best_e = s, z, e
            continue
        better = e < best_e
        best_s = torch.where(better, s, best_s)
        best_z = torch.where(better, z, best_z)
        best_e = torch.minimum(e, best_e)
    assert best_s is not None and best_z is not None
    return best_s, best_z


def gptq_int4(
    w: torch.Tensor,
    h: torch.Tensor,
    group_size: int,
    act_order: bool = ACT_ORDER["int4"],
    clip_ratios: tuple[float, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) -> (uint8 q (N, K) unpacked, float32 scale (N, K/G), uint8 zero (N, K/G)): the
    layout of ``formats.quantize_int4``, GPTQ-rounded, each group's scale and zero fitted
    by ``fit_int4_group`` with ``clip_ratios`` (None: ``CLIP_RATIOS``) and the group's
    block of ``h``."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} must divide K={k}")
    ratios = CLIP_RATIOS if clip_ratios is None else clip_ratios
    scales = torch.empty(n, k // group_size, device=w.device)
    zeros = torch.empty_like(scales)
    at = [0]

    def fit(wg: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        g0 = at[0] * group_size
        hg = h[g0 : g0 + group_size, g0 : g0 + group_size] if ratios != (1.0,) else None
        s, z = fit_int4_group(wg, hg, ratios)
        scales[:, at[0]], zeros[:, at[0]] = s, z
        at[0] += 1
        return lambda col: qf.int4_qdq(col, s, z)

    deq = gptq_round(w, h, fit, group_size, act_order)
    g = deq.reshape(n, k // group_size, group_size)
    q = qf.int4_codes(g, scales[..., None], zeros[..., None]).reshape(n, k)
    return q, scales, zeros.to(torch.uint8)
