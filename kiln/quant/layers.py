"""``QuantLinear``, the quantized projection (the passes that swap the decoder layers'
``Linear`` modules for it are in ``kiln.quant.passes``).

State of a ``QuantLinear`` (stable names; they are the engine file's tensor names):

=============  ==========================  ==========================================
name           dtype                       shape
=============  ==========================  ==========================================
weight         float8_e4m3fn / int8        (N, K)   fp8, int8-wo, w8a8-sq
weight         float8_e4m3fn               (N, K + 2C) fp8 "outliers" activations
weight         uint8 (two int4 per byte)   (N, K/2) int4-awq
weight_scale   float32; int4-awq float16   (N,) or (N, K/G) for int4-awq,
               (float32 where a scale is   (ceil(N/128), ceil(K/128)) fp8 "block"
               off float16's grid)
weight_zero    uint8 (0..15)               (N, K/G) int4-awq only
input_scale    float32                     ()       fp8 with static activations only
smooth         float32                     (K,)     int4-awq, w8a8-sq, fp8 "smooth" (ones: none)
outlier_idx    int64                       (C,)     fp8 "outliers" activations only
input_perm     int64                       (K,)     int4 / int8 weight-only act order only
bias           engine dtype                (N,)     when the projection has one
=============  ==========================  ==========================================

``smooth`` is the per-input-channel factor ``s`` of AWQ / SmoothQuant: the stored weight
quantizes ``w * s[None, :]`` and forward computes ``x / s``. The factors themselves come
from the algorithms (``input_scales``); without them int4-awq is round-to-nearest int4 and
w8a8-sq is w8a8 without smoothing.

fp8 "outliers" activations: the C input channels ``outlier_idx`` (increasing) are carried
in two e4m3 parts each, on both sides of the one fp8 GEMM. The weight is ``[W | W_hi |
W_lo]``: W the per-row-scaled e4m3 weight (its outlier columns are ``W_hi``, the scale
covering them), ``W_lo = e4m3(w / scale - W_hi)`` the rounding error of those columns;
the input is ``[q | lo | hi]`` (``kiln.kernels.quant_act``), so the product adds
``lo * W_hi + hi * W_lo`` to ``hi * W_hi``: each outlier product is carried to about
2**-8 of itself (bfloat16's precision) instead of e4m3's 2**-4, at 2C more columns of
the same GEMM.

fp8 "block" (``weight_block`` 128): one weight scale per 128 x 128 tile and one activation
scale per token and 128 input channels (``kiln.quant.formats.FP8_BLOCK``), in one
``torch._scaled_mm`` with block scales on the GPU.

``input_perm`` (checkpoints quantized in act order whose groups interleave along K, e.g.
GPTQ ``desc_act``): the stored weight's columns are in that order, so that each int4
group is G consecutive columns, and forward gathers ``x[:, input_perm]`` first."""

from __future__ import annotations

import torch
from torch import nn

from kiln.errors import ConfigError, bad_value
from kiln.kernels import wq_tiled
from kiln.kernels.partials import SplitPartials, deferring
from kiln.kernels.quant_act import SEARCHES, QuantAct
from kiln.kernels.wq_f16 import F16Act
from kiln.kernels.wq_gemm import wq_linear
from kiln.layers.linear import Linear
from kiln.quant import formats as qf
from kiln.quant.formats import quantize_act

TARGETS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
"""Projections of every decoder layer that quantization replaces (``layers.{i}.<target>``)."""

_STORAGE = {
    "fp8": qf.FP8_DTYPE,
    "int8-wo": torch.int8,
    "w8a8-sq": torch.int8,
    "int4-awq": torch.uint8,
}


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W stored quantized (see the module docstring for the layout).
    CPU: the float32 references of ``kiln.quant.formats``; CUDA: the ``*_cuda`` paths."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        algo: str,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group_size: int | None = None,
        static_input: bool = False,
        act_outliers: int | None = None,
        smooth: bool = False,
        act_search: int = 0,
        weight_block: int | None = None,
    ) -> None:
        super().__init__()
        if algo not in _STORAGE:
            raise bad_value("quant.algo", algo, f"one of {', '.join(_STORAGE)}")
        if weight_block is not None and (
            weight_block != qf.FP8_BLOCK
            or algo != "fp8"
            or static_input
            or smooth
            or act_outliers is not None
        ):
            raise bad_value(
                "quant.activation_scheme",
                f"block ({weight_block})",
                f"fp8 with {qf.FP8_BLOCK} x {qf.FP8_BLOCK} weight tiles and per-token-and-"
                f"{qf.FP8_BLOCK}-channel activations (with a scale search or not), without "
                "static, smooth or outlier activations",
            )
        # fp8 "block": the weight's tile size and the activations' group (None: per row)
        self.weight_block = weight_block
        if smooth and (algo != "fp8" or static_input or act_outliers is not None):
            raise bad_value(
                "quant.activation_scheme", "smooth", "fp8 with per-token activations only"
            )
        if act_outliers is not None and (
            algo != "fp8" or static_input or not 0 < act_outliers < in_features
        ):
            raise bad_value(
                "quant.act_outliers",
                act_outliers,
                f"fp8 with dynamic activations and fewer than in_features={in_features}",
            )
        if act_search and (algo != "fp8" or static_input or act_search not in SEARCHES):
            raise bad_value(
                "quant.act_scale_search",
                act_search,
                f"one of {', '.join(map(str, SEARCHES[1:]))} for fp8 with per-token activation "
                "scales, else 0",
            )
        # fp8 per-token activations: candidate scales each token's quantization tries (0:
        # amax / 448); not stored in the engine's tensors (the manifest's quant config)
        self.act_search = act_search
        self.in_features, self.out_features, self.algo = in_features, out_features, algo
        self.out_dtype = dtype or torch.get_default_dtype()  # of outputs from QuantAct inputs
        self.group_size = group_size if algo == "int4-awq" else None
        n, k = out_features, in_features
        f32 = dict(dtype=torch.float32, device=device)
        cols = k // 2 if algo == "int4-awq" else k + 2 * (act_outliers or 0)
        self.weight = nn.Parameter(
            torch.empty(n, cols, dtype=_STORAGE[algo], device=device), requires_grad=False
        )
        for name in ("weight_zero", "input_scale", "smooth", "outlier_idx", "input_perm"):
            self.register_buffer(name, None)  # set below when the mode has it
        if algo == "int4-awq":
            if not group_size or k % group_size:
                raise bad_value("quant.group_size", group_size, f"it must divide in_features={k}")
            groups = k // group_size
            # on float16's grid (formats.int4_fit): 2 bytes a group in the engine file
            # and in a step's reads (passes.compact_int4_scales)
            s16 = torch.empty(n, groups, dtype=torch.float16, device=device)
            self.register_buffer("weight_scale", s16)
            self.register_buffer(
                "weight_zero", torch.empty(n, groups, dtype=torch.uint8, device=device)
            )
        elif weight_block:
            tiles = (-(-n // weight_block), -(-k // weight_block))
            self.register_buffer("weight_scale", torch.empty(tiles, **f32))
        else:
            self.register_buffer("weight_scale", torch.empty(n, **f32))
        if static_input:
            self.register_buffer("input_scale", torch.empty((), **f32))
        if act_outliers is not None:  # split in two e4m3 parts (the module docstring)
            idx = torch.empty(act_outliers, dtype=torch.int64, device=device)
            self.register_buffer("outlier_idx", idx)
        if algo in ("int4-awq", "w8a8-sq") or smooth:
            self.register_buffer("smooth", torch.empty(k, **f32))
        # whether the smoothing factors do anything (all ones: skipped at run time), and
        # their reciprocals for the weight-only kernels; kept by ``refresh_smooth``
        self.smooth_active = self.smooth is not None
        self.register_buffer("smooth_inv", None, persistent=False)
        self.register_load_state_dict_post_hook(lambda mod, _keys: mod.refresh_smooth())
        # int4 on the GPU: the weight tile-major for the float16-code kernel, which steps of
        # up to this many rows run (``tile_for_f16``; kiln/kernels/wq_tiled.py); 0: not
        self.f16_rows = 0
        # fp8 "block" on the GPU: the weight and tile scales padded to whole multiples of
        # four tiles (``pad_block_weight``), ``weight`` / ``weight_scale`` views into them
        self.block_padded: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bias = (
            nn.Parameter(torch.empty(n, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls,
        lin: Linear,
        algo: str,
        group_size: int | None = None,
        input_amax: torch.Tensor | float | None = None,
        smooth: torch.Tensor | None = None,
        rounded: tuple[torch.Tensor, ...] | None = None,
        outlier_channels: torch.Tensor | None = None,
        act_search: int = 0,
        weight_block: int | None = None,
    ) -> QuantLinear:
        """Quantize ``lin``. ``input_amax`` (fp8 static) is the calibrated max |x|;
        ``smooth`` (int4-awq, w8a8-sq, fp8 "smooth") the per-input-channel factors, (K,).
        ``rounded``: the weight already quantized by a rounding algorithm (GPTQ,
        kiln/quant/gptq.py) from ``lin.weight * smooth``, as (weight, scale) or for int4
        (unpacked q, scale, zero) in the layouts of ``kiln.quant.formats``; None rounds to
        nearest here.
        ``outlier_channels``: fp8 "outliers" activations, the input channels (C,) carried
        in two e4m3 parts (module docstring). A ``rounded`` weight is expected to hold
        zeros there (GPTQ leaves those columns out) and a scale that covers them.
        ``act_search``: fp8 per-token activations, the candidate scales a token tries.
        ``weight_block``: fp8 "block" (128; a ``rounded`` scale is then per tile)."""
        w = lin.weight
        q = cls(
            lin.in_features,
            lin.out_features,
            algo,
            bias=lin.bias is not None,
            dtype=w.dtype,
            device=w.device,
            group_size=group_size,
            static_input=input_amax is not None,
            act_outliers=None if outlier_channels is None else len(outlier_channels),
            smooth=algo == "fp8" and smooth is not None,
            act_search=act_search,
            weight_block=weight_block,
        )
        wf = w.float()
        if q.smooth is not None:
            s = torch.ones(lin.in_features) if smooth is None else smooth.float().reshape(-1)
            if s.shape != (lin.in_features,) or not bool((s > 0).all()):
                raise ConfigError(
                    f"smoothing factors must be {lin.in_features} positive values; got shape "
                    f"{tuple(s.shape)}."
                )
            q.smooth.copy_(s)
            wf = wf * q.smooth[None, :]
        if rounded is not None:
            if algo not in ("fp8", "int4-awq"):
                raise ConfigError(f"no rounding algorithm is wired for {algo} weights.")
            wq, ws = rounded[0], rounded[1]
            if algo == "int4-awq":
                q.weight_zero.copy_(rounded[2])
                wq = qf.pack_int4(wq)
        elif algo == "fp8" and weight_block:
            wq, ws = qf.quantize_fp8_block_weight(wf, weight_block)
        elif algo == "fp8":
            wq, ws = qf.quantize_fp8_weight(wf)
        elif algo == "int4-awq":
            u, ws, zero = qf.quantize_int4(wf, q.group_size or 0)
            wq = qf.pack_int4(u)
            q.weight_zero.copy_(zero)
        else:
            wq, ws = qf.quantize_int8_weight(wf)
        if outlier_channels is not None:
            idx = outlier_channels.to(device=w.device, dtype=torch.int64).sort().values
            q.outlier_idx.copy_(idx)
            hi, lo = qf.split_fp8_columns(wf[:, idx], ws)
            wq = wq.clone()
            wq[:, idx] = hi
            wq = torch.cat([wq, hi, lo], dim=1)
        q.weight.copy_(wq)
        if algo == "int4-awq":  # float16 on its grid, else float32 as given
            q.weight_scale = qf.int4_scale_storage(ws).to(q.weight_scale.device, copy=True)
        else:
            q.weight_scale.copy_(ws)
        if q.input_scale is not None:
            q.input_scale.copy_(qf.fp8_static_scale(torch.as_tensor(input_amax).float()))
        if lin.bias is not None:
            q.bias.copy_(lin.bias)
        q.refresh_smooth()
        return q

    @property
    def outliers(self) -> torch.Tensor | None:
        """fp8 "outliers" activations: the channels whose values the producer of the input
        writes in two parts after the row (``kiln.kernels.quant_act``); else None."""
        return self.outlier_idx

    @torch.no_grad()
    def expect_input_perm(self) -> None:
        """Give the layer an (empty) ``input_perm`` for ``load_state_dict`` to fill (a
        weight-only layer of a checkpoint quantized in act order)."""
        if self.algo not in ("int8-wo", "int4-awq"):
            raise bad_value("input_perm", self.algo, "weight-only layers (int4-awq, int8-wo)")
        dev = self.weight.device
        self.register_buffer("input_perm", torch.empty(self.in_features, dtype=torch.int64,
                                                       device=dev))  # fmt: skip

    def refresh_smooth(self) -> None:
        """Call after setting ``smooth`` (loading does): identity factors (all ones, as
        AWQ's are once folded into the producer of x) are skipped at run time."""
        s = self.smooth
        self.smooth_active = s is not None and not s.is_meta and bool((s != 1).any())
        # only the weight-only kernels multiply by the reciprocals (w8a8-sq divides x when
        # it quantizes it)
        wo = self.algo in ("int8-wo", "int4-awq")
        self.smooth_inv = 1.0 / s if self.smooth_active and wo else None

    def pad_block_weight(self) -> None:
        """fp8 "block" whose N or K is not a whole multiple of four 128-tiles (cuBLAS's
        block-scaled GEMM takes only those): pad the weight and its tile scales once, in
        place of a copy every call, keeping ``weight`` and ``weight_scale`` as views of
        their real extent (so the CPU emulation and the state dict see the same tensors).
        The loader calls it on the GPU; the extra memory is the padding alone."""
        if not self.weight_block or qf.block_gemm_ok(*self.weight.shape):
            return
        wp, ws = qf.pad_block_weight(self.weight.data, self.weight_scale)
        tn, tk = self.weight_scale.shape
        self.weight = nn.Parameter(wp[: self.out_features, : self.weight.shape[1]],
                                   requires_grad=False)  # fmt: skip
        self.weight_scale = ws[:tn, :tk]
        self.block_padded = (wp, ws)

    def f16_ok(self) -> bool:
        """Whether this layer may take the float16-code int4 kernel: int4 without
        smoothing, act-order permutation or bias, of a shape the kernel takes."""
        from kiln.kernels.wq_f16 import f16_eligible

        return (
            self.algo == "int4-awq" and not self.smooth_active and self.input_perm is None
            and self.bias is None
            and f16_eligible(self.out_features, self.in_features, self.group_size)
        )  # fmt: skip

    @torch.no_grad()
    def tile_for_f16(self, rows: int) -> None:
        """Store the words tile-major (in place of the row-major ones: ``wq_f16.tile_words``)
        and run steps of up to ``rows`` rows on the float16-code kernel; the producer of x
        must then write it prepared at those steps (``kiln.kernels.wq_tiled``). Once: the
        state dict holds the tiled words from then on."""
        from kiln.kernels.wq_f16 import tile_words

        if self.f16_rows or not self.f16_ok() or rows <= 0:
            raise ValueError(f"{self!r}: already tiled, or no float16-code int4 layer")
        self.weight = nn.Parameter(tile_words(self.weight.data), requires_grad=False)
        self.f16_rows = rows

    @property
    def act_kind(self) -> str | None:
        """The per-token dynamic activation quantization this layer applies to its input:
        "fp8" (fp8 without a static scale; with "outliers" the producer writes their 2C
        columns too, from ``outliers``), "int8" (w8a8-sq, after smoothing), or None. A
        producer may apply it instead (``QuantAct`` input; see ``fuse_activation_quant``)."""
        if self.algo == "fp8" and self.input_scale is None:
            return "fp8"
        return "int8" if self.algo == "w8a8-sq" else None

    @property
    def act_quant_args(self) -> tuple:
        """What a producer fusing this layer's dynamic activation quantization passes
        after its own inputs (``rms_norm_quant``, ``silu_and_mul_quant``): kind, smoothing
        factors, outlier channels, scale search and group size."""
        return (self.act_kind, self.smooth, self.outliers, self.act_search, self.weight_block)

    def forward(
        self, x: torch.Tensor | QuantAct | F16Act, partials: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | SplitPartials:  # fmt: skip
        """(T, in) -> (T, out). ``partials``: the caller's consumer adds split-K partials
        itself, so inside ``split_sums_deferred`` a weight-only projection split along K
        returns them (``kiln.kernels.partials``). ``out``: a float32 (T, out) buffer the
        float16-code kernel may write into, rounded to x's dtype first (the head's logits);
        the caller checks whether the result is ``out``."""
        if self.f16_rows:  # tile-major words: x prepared (F16Act) or not
            return wq_tiled.linear(x, self.weight, self.weight_scale, self.weight_zero,
                                   partials=partials and deferring(), out=out)  # fmt: skip
        if self.algo in ("int8-wo", "int4-awq"):
            if self.input_perm is not None:  # act order: the weight's columns are permuted
                x = x.index_select(-1, self.input_perm)
            zero = self.weight_zero if self.algo == "int4-awq" else None
            smooth = self.smooth if self.smooth_active else None
            return wq_linear(x, self.weight, self.weight_scale, zero, smooth, self.bias,
                             smooth_inv=self.smooth_inv,
                             partials=partials and deferring())  # fmt: skip
        if isinstance(x, QuantAct):  # quantized by the producer (smoothing applied there)
            groups = -(-self.in_features // self.weight_block) if self.weight_block else 1
            if self.act_kind is None or x.q.shape[1] != self.weight.shape[1]:
                raise TypeError(
                    f"{self.algo} QuantLinear takes no pre-quantized input of "
                    f"{x.q.shape[1]} columns (its weight has {self.weight.shape[1]})"
                )
            if x.scale.shape[1] != groups:
                raise TypeError(
                    f"{self.algo} QuantLinear takes {groups} activation scale(s) a token, "
                    f"got {x.scale.shape[1]}"
                )
            a, dtype = x, self.out_dtype
        else:
            kind = self.act_kind or "fp8"
            a = quantize_act(x, self.input_scale, kind, self.smooth, self.outliers,
                             self.act_search, self.weight_block)  # fmt: skip
            dtype = x.dtype
        padded = self.block_padded
        if a.q.is_cuda and padded and padded[0].data_ptr() == self.weight.data_ptr():
            return qf._block_matmul_cuda(a, *padded, self.bias, dtype, n=self.out_features)
        mm = qf.act_matmul_cuda if a.q.is_cuda else qf.act_matmul_ref
        return mm(a, self.weight, self.weight_scale, self.bias, dtype)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        g += f", act_outliers={len(self.outlier_idx)}" if self.outlier_idx is not None else ""
        g += f", act_search={self.act_search}" if self.act_search else ""
        g += f", weight_block={self.weight_block}" if self.weight_block else ""
        return f"{self.in_features}, {self.out_features}, algo={self.algo}{g}"
