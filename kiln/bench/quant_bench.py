# ruff: noqa: B023 (the closures are timed within the loop iteration that makes them)
"""Quantized-kernel benchmarks on a GPU (issue 7): FP8 GEMM TFLOP/s (``torch._scaled_mm``
with kiln's row-wise scales) against bf16 cuBLAS, per-token activation quantization alone
and fused into RMSNorm, and the W4A16 / W8A16 kernels against bf16 at decode row counts,
including a few launch configurations per shape (the best is reported beside the
default). Usage: ``python -m kiln.bench.quant_bench out.json [fp8,act,wo|wo-decode,rot]``
(rot: the fp8 cache write with and without the KV rotation)."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
from kiln.bench.kernels import gpu_run_header, median_cuda_ms
from kiln.kernels import f16_prep, wq_config, wq_f16
from kiln.kernels import quant_act as qa
from kiln.kernels import wq_gemm as wq
from kiln.kernels.gemv import linear
from kiln.kernels.rmsnorm import rms_norm_triton
from kiln.quant import formats as qf

DEV = "cuda"


def _tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / ms / 1e9


def bench_fp8_gemm() -> list[dict[str, Any]]:
    rows = []
    shapes = [("cube", 8192, 8192, 8192)] + [
        (name, m, n, k) for m in (1024, 4096, 8192) for name, (n, k) in LLAMA_8B_SHAPES.items()
        if name != "lm_head"
    ]  # fmt: skip
    for name, m, n, k in shapes:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
        wq8, ws = qf.quantize_fp8_weight(w)
        a = qa.quantize_rows_triton(x, "fp8")
        wt, sb = wq8.t(), ws.reshape(1, -1)
        one = torch.ones((), device=DEV)
        mm_row = median_cuda_ms(lambda: torch._scaled_mm(a.q, wt, a.scale, sb, out_dtype=x.dtype))
        mm_tensor = median_cuda_ms(
            lambda: torch._scaled_mm(a.q, wt, one, one, out_dtype=torch.bfloat16)
        )
        quant = median_cuda_ms(lambda: qa.quantize_rows_triton(x, "fp8"))
        bf16 = median_cuda_ms(lambda: F.linear(x, w))
        rows.append({
            "shape": name, "m": m, "n": n, "k": k,
            "fp8_rowwise_ms": mm_row, "fp8_rowwise_tflops": _tflops(m, n, k, mm_row),
            "fp8_tensorwise_tflops": _tflops(m, n, k, mm_tensor),
            "act_quant_ms": quant,
            "fp8_with_act_quant_tflops": _tflops(m, n, k, mm_row + quant),
            "bf16_ms": bf16, "bf16_tflops": _tflops(m, n, k, bf16),
            "speedup_vs_bf16": bf16 / (mm_row + quant),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_act_quant() -> list[dict[str, Any]]:
    rows = []
    for m, h in ((1, 4096), (256, 4096), (1024, 4096), (8192, 4096), (1024, 14336)):
        x = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.rand(h, device=DEV, dtype=torch.bfloat16) + 0.5
        triton_ms = median_cuda_ms(lambda: qa.quantize_rows_triton(x, "fp8"))
        torch_ms = median_cuda_ms(lambda: qa.quantize_rows_ref(x, "fp8"))
        norm_then_quant = median_cuda_ms(
            lambda: qa.quantize_rows_triton(rms_norm_triton(x, w, 1e-5, r)[0], "fp8")
        )
        fused = median_cuda_ms(lambda: qa.rms_norm_quant_triton(x, w, 1e-5, r, "fp8"))
        rows.append({"m": m, "k": h, "quant_triton_ms": triton_ms, "quant_torch_ms": torch_ms,
                     "rmsnorm_then_quant_ms": norm_then_quant,
                     "rmsnorm_quant_fused_ms": fused})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_act_search() -> list[dict[str, Any]]:
    """fp8 activation quantization with the per-token scale search (``--act-scale-search``)
    at 0, 2, 4 and 8 candidates: alone, fused into RMSNorm (Llama-3.1-8B's hidden 4,096)
    and into SiLU-mul (its 14,336), from decode to prefill row counts."""
    rows = []
    for m in (1, 256, 2048, 8192, 16384):
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.rand(4096, device=DEV, dtype=torch.bfloat16) + 0.5
        h = torch.randn(m, 2 * 14336, device=DEV, dtype=torch.bfloat16)
        for n in (0, 2, 4, 8):
            rows.append({
                "m": m, "search": n,
                "quant_4096_ms": median_cuda_ms(
                    lambda: qa.quantize_rows_triton(x, "fp8", None, None, n)),
                "rmsnorm_quant_4096_ms": median_cuda_ms(
                    lambda: qa.rms_norm_quant_triton(x, w, 1e-5, r, "fp8", None, None, n)),
                "silu_mul_quant_14336_ms": median_cuda_ms(
                    lambda: qa.silu_and_mul_quant_triton(h, "fp8", None, None, n)),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_kv_rotation() -> list[dict[str, Any]]:
    """The fused rotary + fp8 cache write at Llama-3.1-8B's heads (32 q, 8 kv, 128 wide),
    with and without the Hadamard rotation of q and k, from decode to prefill sizes."""
    from kiln.kernels.hadamard import hadamard_signs
    from kiln.kernels.rotary import rotary_write_kv_triton
    from kiln.layers.rotary import RotaryEmbedding

    hq, hk, d, bs = 32, 8, 128, 32
    cs = RotaryEmbedding(d, 16384, 500000.0, None).cos_sin(torch.device(DEV))
    signs = hadamard_signs(d, DEV, torch.bfloat16)
    rows = []
    for t in (1, 64, 1024, 8192):
        qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV, dtype=torch.bfloat16)
        pos = torch.arange(t, device=DEV)
        cache = torch.zeros(2, -(-t // bs) + 1, bs, hk, d, device=DEV).to(torch.float8_e4m3fn)
        slots = torch.arange(t, device=DEV)
        scale = torch.ones(2, device=DEV)
        plain = median_cuda_ms(
            lambda: rotary_write_kv_triton(qkv, pos, cs, cache, slots, hq, hk, d, scale)
        )
        rotated = median_cuda_ms(
            lambda: rotary_write_kv_triton(qkv, pos, cs, cache, slots, hq, hk, d, scale, signs)
        )
        rows.append({"tokens": t, "plain_ms": plain, "rotated_ms": rotated,
                     "ratio": rotated / plain})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _wq_weights(n: int, k: int, int4: bool, group: int, copies: int) -> list[tuple]:
    from kiln.quant.passes import SCALE16

    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device=DEV) / k**0.5
        if int4:  # the scales as loads hold them (``passes.compact_int4_scales``)
            u, s, z = qf.quantize_int4(w, group)
            out.append((qf.pack_int4(u), qf.int4_scale_storage(s) if SCALE16 else s, z))
        else:
            q, s = qf.quantize_int8_weight(w)
            out.append((q, s, None))
    return out


_MMA_CANDIDATES = (  # (R, warps, split, CH, PF)
    (1, 8, 1, 2, True), (1, 8, 1, 2, False), (1, 2, 4, 2, False), (1, 4, 2, 2, False),
    (2, 2, 4, 2, False), (2, 4, 2, 2, False), (2, 4, 4, 2, False), (1, 4, 4, 1, False),
    (1, 8, 2, 1, False), (2, 1, 4, 2, False), (2, 1, 2, 2, False), (2, 2, 2, 2, False),
    (2, 2, 1, 2, True), (2, 4, 1, 2, False), (2, 4, 4, 4, False), (1, 8, 1, 4, False),
    (2, 2, 2, 4, False), (2, 1, 4, 4, False),
    # past the edge of the list: the H200's one-row pick for down (the weakest projection,
    # 2.0 TB/s) was R 1, 4 warps, split 4, CH 1, the largest R-1 split listed (2026-12-02)
    (1, 4, 8, 1, False), (1, 2, 8, 1, False), (1, 8, 4, 1, False),
)  # fmt: skip
_MMA_MANY_ROWS = (  # (R, warps, split, CH, NT) past 16 rows: NT 4 (R 2: one chunk a step), or 8
    (1, 4, 1, 2, 4), (1, 4, 2, 2, 4), (1, 8, 1, 2, 4), (1, 2, 2, 2, 4), (1, 4, 4, 2, 4),
    (2, 4, 1, 1, 4), (2, 4, 2, 1, 4), (2, 2, 2, 1, 4), (2, 4, 4, 1, 4), (1, 4, 1, 1, 8),
    (1, 8, 1, 1, 8), (1, 4, 2, 1, 8),
)  # fmt: skip


_F16_CANDIDATES = (  # (R, warps, split, CH, PF): scripts/experiments/int4_mma_f16.py's list
    (1, 8, 1, 2, True), (1, 8, 1, 2, False), (1, 2, 4, 2, False), (1, 4, 2, 2, False),
    (2, 2, 4, 2, False), (2, 4, 2, 2, False), (2, 4, 4, 2, False), (1, 4, 4, 1, False),
    (1, 8, 2, 1, False), (2, 1, 4, 2, False), (2, 1, 2, 2, False), (2, 2, 2, 2, False),
    (2, 2, 1, 2, True), (2, 4, 1, 2, False), (1, 4, 8, 1, False), (1, 2, 8, 1, False),
    (1, 8, 4, 1, False), (2, 1, 1, 2, False), (2, 2, 1, 1, False), (2, 2, 2, 1, False),
    (1, 4, 1, 1, False), (1, 4, 2, 1, False), (2, 1, 8, 2, False), (1, 2, 4, 1, False),
    # PF 2, two iterations a trip: on an H100 (results/2026-12-06-h100-f16-pingpong.json)
    # the best of its kind at gate_up (2, 2, 1, 1) and down (1, 8, 2, 1), and faster than PF
    # 1 at the H200's gate_up pick (2, 2, 1, 2) and at qkv / o (1, 8, 1, 2)
    (2, 2, 1, 2, 2), (2, 2, 1, 1, 2), (1, 8, 1, 2, 2), (1, 8, 2, 1, 2),
)  # fmt: skip


def f16_candidates(n: int, k: int, m: int, group: int | None) -> list[dict[str, Any]]:
    """The float16-code kernel's configurations (``kiln.kernels.wq_f16``) at ``m`` rows,
    where it takes the shape: up to eight rows (the H100 and H200 sweeps' list); none
    unless ``wq_f16.ENABLED`` (on unless ``KILN_WQ_F16=0``)."""
    if not wq_f16.ENABLED or m > wq_f16.MAX_M or not wq_f16.f16_eligible(n, k, group):
        return []
    return [wq_f16.f16_config(*c) for c in _F16_CANDIDATES]


def wq_config_candidates(m: int, group: int | None, k: int | None = None) -> list[dict[str, Any]]:
    """Launch configurations of the weight-only kernels for the tuner at ``m`` rows: int4
    up to 8 rows with groups of whole 128-code chunks the tensor-core kernel
    (``kiln.kernels.wq_mma``; the launcher checks K and x and falls back); int4 at one row
    the 32-bit-word kernel (its Gluon form where the group is a multiple of 32, and the
    Triton form; the broadcast-multiply kernel, 1.3-1.6x slower in the sweeps, is no
    longer timed there); up to ``WQ_FMA_MAX_M`` rows otherwise the broadcast-multiply
    kernel (int4 K tiles that divide the group or hold whole groups); tensor cores from
    two rows on (K tiles within a group). With ``k`` where the tensor-core kernel takes
    the shape (``mma_eligible``), 2-8 rows time it alone: in the tunings of int4-awq
    Llama-3.1-8B on the H200 it beat every other kernel there, and the build saves their
    timings (the launcher still falls back for calls it cannot take). 9-16 rows: its
    candidates beside the others'; past 16 (up to ``mma_rows()``) its many-token-tile
    candidates (``_MMA_MANY_ROWS``) beside four wide tensor-core tiles."""
    out = []
    many = 2 * wq.MMA_MAX_M < m <= wq.mma_rows()
    if group and many and group % wq.MMA_CHUNK == 0:
        out = [wq.mma_config(r, warps, split, ch, False, nt)
               for r, warps, split, ch, nt in _MMA_MANY_ROWS]  # fmt: skip
        if wq_config.ZSUB:  # the same with the zero point off the codes (experimental)
            out += [c | {"ZS": True} for c in out]
    elif group and m <= wq.mma_rows() and group % wq.MMA_CHUNK == 0:
        # int4_mma.py's sweep: each Llama-3.1-8B projection's five fastest, and four-chunk steps
        for r, warps, split, ch, pf in _MMA_CANDIDATES:
            out.append(wq.mma_config(r, warps, split, ch, pf))
        if wq_config.ZSUB:  # the same with the zero point off the codes (experimental)
            out += [c | {"ZS": True} for c in out]
        if 1 < m <= wq.MMA_MAX_M and k is not None and wq.mma_eligible(k, m, group):
            return out  # at 9-16 rows the other kernels compete
    words = m == 1 and group is not None
    if words and group % 32 == 0:  # the word kernel's Gluon form (int4_row_gluon.py sweep)
        # two chunks of 32 codes per thread (K tiles of 4,096 on 2 warps) came out ahead
        # once x was read in 16-byte loads (int4_row_stream.py); four spill
        tiles = ((8, 2048, 2), (8, 4096, 4), (8, 1024, 1), (4, 2048, 2), (8, 4096, 2),
                 (4, 4096, 2))  # fmt: skip
        for bn, bk, warps in tiles:
            for split in (1, 2, 4, 8):
                out.append({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "FMA": True,
                            "WORDS": True, "GLUON": True, "num_warps": warps,
                            "num_stages": 2})  # fmt: skip
    if words:  # its Triton form (int4_row_words.py sweep); groups like 96: tiles within one
        tiles = ((64, 512, 4), (64, 256, 4), (128, 256, 4), (32, 512, 4), (64, group & -group, 4))
        for bn, bk, warps in dict.fromkeys(tiles):
            if (group % bk and bk % group) or bk < 8:
                continue
            for split in (1, 4, 8):
                out.append({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "FMA": True,
                            "WORDS": True, "num_warps": warps, "num_stages": 2})  # fmt: skip
    if m <= wq.WQ_FMA_MAX_M and not words:  # int4 at one row: the word kernels beat it
        tiles = ((8, 512, 4), (16, 512, 4), (32, 512, 4), (8, 1024, 4), (16, 1024, 4),
                 (16, 1024, 8), (32, 1024, 8), (32, 256, 4))  # fmt: skip
        for bn, bk, warps in tiles:
            if group and group % bk and bk % group:
                continue
            for split in (1, 2, 4, 8):
                out.append({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "FMA": True,
                            "num_warps": warps, "num_stages": 2})  # fmt: skip
    if m > 1:
        bks = [b for b in (128, 256) if not group or group % b == 0] or [group & -group]
        # past 16 rows with the tensor-core kernel's candidates: the wide tiles only
        for bn in (64, 128) if out and many else (32, 64, 128):
            for bk in bks:
                for split in (1, 2) if out and many else (1, 2, 4, 8):
                    out.append({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
                                "num_warps": 4, "num_stages": 3 if group else 4})  # fmt: skip
    return out


def weight_only_copies(n: int, k: int, group: int | None, empty: bool = False) -> list[tuple]:
    """The random weights ``tune_weight_only`` times (enough copies to pass 256 MiB, so
    that they come from memory): make them once per shape for all its row counts.
    ``empty``: one uninitialized set for a dry run (whose launches are deferred), shaped and
    typed after a 16-row quantized weight (only N differs)."""
    if empty:
        small = _wq_weights(16, k, group is not None, group or 0, 1)[0]
        return [tuple(None if t is None else t.new_empty((n, *t.shape[1:])) for t in small)]
    return _wq_weights(n, k, group is not None, group or 0, rotation_copies(n * k, 256 << 20))


def tune_weight_only(
    n: int,
    k: int,
    m: int,
    group: int | None,
    reps: int = 5,
    ws: list[tuple] | None = None,
    timed: bool = True,
) -> list[dict[str, Any]]:
    """Every candidate of ``wq_config_candidates`` (and of ``f16_candidates``: x prepared
    by ``f16_prep.prep_ref``, the words tile-major) timed at (m, n, k) on random int4 (group
    ``group``, unsmoothed) or int8 weights (``ws``, else new ``weight_only_copies``),
    fastest first; failing candidates (errors, or results off the float32 reference by
    more than 4 bfloat16 ulp of the largest output, the kernel tests' tolerance) last, with
    their error. Requests that run the same launch are timed once. ``timed`` False: each
    candidate is only called, unchecked (``kiln.runtime.kernel_record.precompile``'s dry
    run, whose launches are deferred), in the order given."""
    ws = ws if ws is not None else weight_only_copies(n, k, group)
    idx = {id(t[0]): t for t in ws}
    f16 = f16_candidates(n, k, m, group)
    tiled = {id(t[0]): wq_f16.tile_words(t[0]) for t in ws} if f16 else {}
    # no smoothing: kiln's int4-awq builds fold AWQ's factors into the producers of x
    smooth = None
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    # the dry run's kernels are deferred (their results unread): no float32 reference
    ref = wq.wq_linear_ref(x, *ws[0][:3]).float() if timed else None
    act = wq_f16.F16Act(*f16_prep.prep_ref(x), x.dtype) if f16 else None
    rows = []
    seen = set()
    for cfg in wq_config_candidates(m, group, k) + f16:
        # requests past the tile count run the same launch: time it once
        split = wq.split_k_plan(k, cfg["BLOCK_K"], cfg["SPLIT_K"])[1]
        key = tuple(sorted((cfg | {"SPLIT_K": split}).items()))
        if key in seen:
            continue
        seen.add(key)

        def run(p: torch.Tensor, c: dict[str, Any] = cfg) -> torch.Tensor:
            _, s, z = idx[id(p)]
            if c.get("F16"):  # x prepared, the same words tile-major
                return wq_f16.wq4_f16(act, tiled[id(p)], s, z, c)
            return wq.wq_linear_triton(x, p, s, z, smooth, None, c)

        try:  # a candidate must match the reference before it is timed
            out = run(ws[0][0])
            if ref is None:
                rows.append({"config": cfg})
                continue
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            if not err <= 2**-6:
                raise ValueError(f"wrong result: max error {err:.2e} of the largest output")
            ms = time_per_call_ms(run, [t[0] for t in ws], reps=reps)
        except Exception as e:  # a failing candidate is a result, not an error
            rows.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"config": cfg, "ms": ms})
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


def bench_weight_only(
    tune: bool = True, ms: tuple[int, ...] = (1, 4, 16, 32, 64, 128, 256)
) -> list[dict[str, Any]]:
    rows = []
    for mode, int4 in (("int4-g128", True), ("int8", False)):
        for name, (n, k) in LLAMA_8B_SHAPES.items():
            if name == "lm_head":
                continue
            wbytes = n * k // (2 if int4 else 1)
            copies = rotation_copies(wbytes)
            ws = _wq_weights(n, k, int4, 128, copies)
            bf = [
                torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
                for _ in range(max(2, copies // 4))
            ]
            smooth = torch.rand(k, device=DEV) + 0.5 if int4 else None
            for m in ms:
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                idx = {id(t[0]): t for t in ws}

                def run(p: torch.Tensor) -> torch.Tensor:  # the active configuration
                    _, s, z = idx[id(p)]
                    return wq.wq_linear_triton(x, p, s, z, smooth)

                def deq(p: torch.Tensor) -> torch.Tensor:
                    _, s, z = idx[id(p)]
                    return F.linear(x, wq.dequantize_triton(p, s, z, k, x.dtype))

                packed = [t[0] for t in ws]
                fused = time_per_call_ms(run, packed, reps=10)
                best, best_cfg = fused, None
                if tune and m in (1, 4, 16):
                    top = tune_weight_only(n, k, m, 128 if int4 else None)[0]
                    if top.get("ms", float("inf")) < best:
                        best, best_cfg = top["ms"], top["config"]
                dq = time_per_call_ms(deq, packed, reps=5)
                bf16 = time_per_call_ms(lambda w: linear(x, w), bf, reps=10)
                rows.append({
                    "mode": mode, "shape": name, "m": m, "n": n, "k": k,
                    "fused_ms": fused, "fused_tbps": wbytes / fused / 1e9,
                    "tuned_ms": best, "tuned_config": best_cfg,
                    "dequant_cublas_ms": dq, "bf16_ms": bf16,
                    "speedup_vs_bf16": bf16 / min(fused, best),
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            del ws, bf
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    out: dict[str, Any] = gpu_run_header("quant-kernels")
    parts = argv[1].split(",") if len(argv) > 1 else ["fp8", "act", "wo"]
    if "fp8" in parts:
        out["fp8_gemm"] = bench_fp8_gemm()
    if "act" in parts:
        out["act_quant"] = bench_act_quant()
    if "wo" in parts:
        out["weight_only"] = bench_weight_only()
    elif "wo-decode" in parts:  # decode row counts only
        out["weight_only"] = bench_weight_only(ms=(1, 4, 16))
    if "rot" in parts:
        out["kv_rotation"] = bench_kv_rotation()
    if "search" in parts:
        out["act_search"] = bench_act_search()
    with open(argv[0], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
