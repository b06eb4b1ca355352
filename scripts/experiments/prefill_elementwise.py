"""Experiment (H200): the elementwise kernels of an fp8 + fp8-KV prompt step against their
memory traffic, and variants of the two furthest from it (2026-12-02 profile at 2048/128:
SiLU·mul + fp8 quantization 6.2 % of kernel time, rotary + fp8 KV write 5.4 %).

1. SiLU·mul + per-token fp8 quantization (``quant_act._silu_mul_quant_kernel``) at 2,048,
   8,192 and 16,384 rows of Llama-3.1-8B's 14,336 channels: the engine's launch (a row a
   program, the row padded to 16,384 lanes, 16 warps), the same at 32 warps, and a
   two-pass variant (each program takes one row in chunks: the row's max |y| first, then y
   again from the re-read inputs, quantized and stored), at a few chunk sizes and warps.
   Every variant's output is compared with the engine kernel's (the same bits expected).
2. Rotary + fp8 KV write (``rotary._rotary_kv_kernel``) at 2,048, 8,192 and 16,384 tokens
   (32 q heads, 8 kv heads, 128 dims): the engine's launches (q part, kv part) with the
   Hadamard rotation and without it, and the rotated q and kv parts at BLOCK_R 128 and at
   8 warps.
3. RMSNorm + residual + fp8 quantization at the same rows, as a reference point.

Bandwidth: bytes that must move (inputs read once, outputs written once) over the median
CUDA-event time. Usage: ``PYTHONPATH=. python scripts/experiments/prefill_elementwise.py
OUT.json``."""

import json
import sys

import torch
import triton
import triton.language as tl

from kiln.bench.kernels import median_cuda_ms
from kiln.kernels import quant_act as qa
from kiln.kernels import rotary as rt
from kiln.kernels.hadamard import hadamard_signs


@triton.jit
def _silu_quant_2pass(x_ptr, q_ptr, s_ptr, stride_x, stride_q, inter, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    amax = tl.zeros([CHUNK], tl.float32)
    for c in range(0, inter, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        m = offs < inter
        g = tl.load(base + offs, mask=m, other=0.0)
        u = tl.load(base + inter + offs, mask=m, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        y = ((gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32) * u).to(g.dtype)
        amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    for c in range(0, inter, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        m = offs < inter
        g = tl.load(base + offs, mask=m, other=0.0)
        u = tl.load(base + inter + offs, mask=m, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        y = ((gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32) * u).to(g.dtype)
        q = qa.to_fp8(y.to(tl.float32), scale, False)
        tl.store(q_ptr + row.to(tl.int64) * stride_q + offs, q, mask=m)
    tl.store(s_ptr + row, scale)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def silu(rows_out: list) -> None:
    inter = 14336
    for m in (2048, 8192, 16384):
        x = (torch.randn(m, 2 * inter, device="cuda") * 3).to(torch.bfloat16)
        nbytes = m * 2 * inter * 2 + m * inter + m * 4
        ref = qa.silu_and_mul_quant_triton(x, "fp8")
        row: dict = {"rows": m, "bytes": nbytes}

        def engine(warps: int | None = None):
            out = qa._outputs(m, inter, "fp8", x.device, None, None)
            opts = qa._launch_opts(inter, "fp8", None, None)
            if warps:
                opts["num_warps"] = warps
            qa._silu_mul_quant_kernel[(m,)](x, out.q, out.scale, out.scale, out.scale,
                                            x.stride(0), out.q.stride(0), inter, **opts)  # fmt: skip
            return out

        def two_pass(chunk: int, warps: int):
            out = qa._outputs(m, inter, "fp8", x.device, None, None)
            _silu_quant_2pass[(m,)](x, out.q, out.scale, x.stride(0), out.q.stride(0), inter,
                                    CHUNK=chunk, num_warps=warps)  # fmt: skip
            return out

        variants = {"engine": lambda: engine(), "engine_w32": lambda: engine(32)}
        for chunk, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)):
            variants[f"2pass_c{chunk}_w{warps}"] = (lambda c=chunk, w=warps: two_pass(c, w))
        for name, fn in variants.items():
            got = fn()
            same = bool(torch.equal(got.q.view(torch.uint8), ref.q.view(torch.uint8))) and bool(
                torch.equal(got.scale, ref.scale)
            )
            ms = median_cuda_ms(fn, 20)
            row[name] = {"ms": ms, "GBps": _gbps(nbytes, ms), "same_bits": same}
        print(json.dumps({"silu_rows": m, **{k: (round(v["ms"] * 1e3, 1), round(v["GBps"]),
              v["same_bits"]) for k, v in row.items() if isinstance(v, dict)}}), flush=True)  # fmt: skip
        rows_out.append(row)
        del x, ref


def rotary(rows_out: list) -> None:
    hq, hk, d, bs = 32, 8, 128, 32
    signs = hadamard_signs(d, "cuda", torch.bfloat16)
    cs = torch.randn(8192, d, device="cuda")
    for t in (2048, 8192, 16384):
        qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 8192, (t,), device="cuda")
        blocks = t // bs + 1
        cache = torch.zeros(2, blocks, bs, hk, d, device="cuda", dtype=torch.float8_e4m3fn)
        slots = torch.randperm(blocks * bs, device="cuda")[:t]
        ks = torch.tensor([0.05, 0.05], device="cuda")
        q_out = torch.empty(t, hq, d, dtype=qkv.dtype, device="cuda")
        q_bytes = t * hq * d * 2 * 2
        kv_bytes = t * hk * d * 2 * 2 + t * hk * d * 2
        row: dict = {"tokens": t, "q_bytes": q_bytes, "kv_bytes": kv_bytes}

        def launch(part: int, rotate: bool, block_r: int, warps: int = 4) -> None:
            # as the launcher: q programs over (token, head) rows, kv programs one head's tokens
            grid = (triton.cdiv(t * hq, block_r) if part == 1 else hk * triton.cdiv(t, block_r),)
            rt._rotary_kv_kernel[grid](
                qkv, pos, cs, slots, q_out, cache, ks, signs, d**-0.5, qkv.stride(0),
                cs.stride(0), q_out.stride(0), q_out.stride(1), cache.stride(0),
                cache.stride(1), cache.stride(2), cache.stride(3), t, hq, hk, bs, D=d,
                HALF=d // 2, HALF_PAD=d // 2, BLOCK_R=block_r, FP8=True, EMULATE_FP8=False,
                ROTATE=rotate, UPCAST=False, PRECISION="tf32", PART=part, num_warps=warps,
                **({"maxnreg": 128} if part == 1 and warps == 4 and block_r == 64 else {}),
            )  # fmt: skip

        ref_q = rt.rotary_write_kv_triton(qkv, pos, cs, cache, slots, hq, hk, d, ks, signs)
        ref_cache = cache.clone()
        row["engine_ms"] = median_cuda_ms(
            lambda: rt.rotary_write_kv_triton(qkv, pos, cs, cache, slots, hq, hk, d, ks, signs)
        )
        for name, part, rotate, block_r, warps in (
            ("q_rot_r64_w4", 1, True, 64, 4), ("kv_rot_r64_w4", 2, True, 64, 4),
            ("q_norot_r64_w4", 1, False, 64, 4), ("kv_norot_r64_w4", 2, False, 64, 4),
            ("q_rot_r128_w4", 1, True, 128, 4), ("kv_rot_r128_w4", 2, True, 128, 4),
            ("q_rot_r128_w8", 1, True, 128, 8), ("kv_rot_r128_w8", 2, True, 128, 8),
            ("q_rot_r64_w8", 1, True, 64, 8), ("kv_rot_r64_w8", 2, True, 64, 8),
        ):  # fmt: skip
            fn = (lambda p=part, r=rotate, b=block_r, w=warps: launch(p, r, b, w))
            cache.zero_()
            fn()
            same = None
            if rotate:
                same = bool(torch.equal(q_out, ref_q)) if part == 1 else bool(
                    torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)))
            ms = median_cuda_ms(fn, 20)
            nb = q_bytes if part == 1 else kv_bytes
            row[name] = {"ms": ms, "GBps": _gbps(nb, ms), "same_bits": same}
        print(json.dumps({"rotary_tokens": t, "engine_ms": round(row["engine_ms"], 4),
              **{k: (round(v["ms"] * 1e3, 1), round(v["GBps"]), v["same_bits"])
                 for k, v in row.items() if isinstance(v, dict)}}), flush=True)  # fmt: skip
        rows_out.append(row)


def rmsnorm(rows_out: list) -> None:
    h = 4096
    for m in (2048, 8192, 16384):
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5
        ms = median_cuda_ms(lambda: qa.rms_norm_quant_triton(x, w, 1e-5, r, "fp8"))
        nbytes = m * h * (2 + 2 + 2 + 1) + m * 4
        rows_out.append({"rmsnorm_rows": m, "ms": ms, "GBps": _gbps(nbytes, ms)})
        print(json.dumps(rows_out[-1]), flush=True)


def main() -> None:
    out = {"note": __doc__, "device": torch.cuda.get_device_name(), "silu": [], "rotary": [],
           "rmsnorm": []}  # fmt: skip
    silu(out["silu"])
    rotary(out["rotary"])
    rmsnorm(out["rmsnorm"])
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
