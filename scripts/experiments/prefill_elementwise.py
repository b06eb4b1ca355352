"""Experiment (H200): the elementwise kernels of an fp8 + fp8-KV prompt step against their
memory traffic, and variants of the two furthest from it (2026-12-02 profile at 2048/128:
SiLU·mul + fp8 quantization 6.2 % of kernel time, rotary + fp8 KV write 5.4 %).

1. SiLU·mul + per-token fp8 quantization (``quant_act._silu_mul_quant_kernel``) at 2,048,
   8,192 and 16,384 rows of Llama-3.1-8B's 14,336 channels: the engine's launch (a row a
   program, the row padded to 16,384 lanes, 16 warps), the same at 32 warps, and a
   two-pass variant (each program takes one row in chunks: the row's max |y| first, then y
   again from the re-read inputs, quantized and stored), at a few chunk sizes and warps.
   Every variant's output is compared with the engine kernel's (the same bits expected).
   Later (SILU_SET=markstein, the default now): the quotient x / scale as x * (1 / scale)
   with one fma correction (Markstein), instead of a correctly rounded division an
   element, at 8, 16 and 32 warps (at 8bb58de a copy of the kernel with that arithmetic;
   since then the engine kernel itself, whose ``to_fp8`` computes it).
2. Rotary + fp8 KV write (``rotary._rotary_kv_kernel``) at 2,048 and 16,384 tokens (32 q
   heads, 8 kv heads, 128 dims): the kv programs (with the Hadamard rotation) of this
   commit's kernel (one kv head's consecutive tokens a program) against a6971b4's ((token,
   head) rows; ``rotary_a6971b4.py``, a copy), over a prompt's slots and over scattered
   slots. (The first run of this script, at a6971b4, timed the q and kv parts with and
   without the rotation, at BLOCK_R 64 / 128 and 4 / 8 warps, over scattered slots only.)
3. RMSNorm + residual + fp8 quantization at the same rows, as a reference point.

Bandwidth: bytes that must move (inputs read once, outputs written once) over the median
CUDA-event time. Usage: ``PYTHONPATH=. python scripts/experiments/prefill_elementwise.py
OUT.json``."""

import json
import os
import sys

import torch
import triton
import triton.language as tl

from kiln.bench.kernels import median_cuda_ms
from kiln.kernels import quant_act as qa
from kiln.kernels import rotary as rt
from kiln.kernels.hadamard import hadamard_signs

SILU_SET = os.environ.get("SILU_SET", "markstein")


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
            out = qa._outputs(m, inter, "fp8", x.device, None, None, 0, None)
            opts = qa._launch_opts(inter, "fp8", None, None, 0, None)
            if warps:
                opts["num_warps"] = warps
            qa._silu_mul_quant_kernel[(m,)](x, out.q, out.scale, out.scale, out.scale,
                                            x.stride(0), out.q.stride(0), out.scale.stride(1),
                                            inter, **opts)  # fmt: skip
            return out

        def two_pass(chunk: int, warps: int):
            out = qa._outputs(m, inter, "fp8", x.device, None, None, 0, None)
            _silu_quant_2pass[(m,)](x, out.q, out.scale, x.stride(0), out.q.stride(0), inter,
                                    CHUNK=chunk, num_warps=warps)  # fmt: skip
            return out

        variants = {"engine": lambda: engine()}
        if "2pass" in SILU_SET:  # the first run (a6971b4): 32 warps, two passes
            variants["engine_w32"] = lambda: engine(32)
            for chunk, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)):
                variants[f"2pass_c{chunk}_w{warps}"] = lambda c=chunk, w=warps: two_pass(c, w)
        for warps in (8, 16, 32):  # the engine kernel, whose to_fp8 is Markstein's since 8bb58de
            variants[f"markstein_w{warps}"] = lambda w=warps: engine(w)
        for name, fn in variants.items():
            got = fn()
            same = bool(torch.equal(got.q.view(torch.uint8), ref.q.view(torch.uint8))) and bool(
                torch.equal(got.scale, ref.scale)
            )
            ms = median_cuda_ms(fn, 20)
            row[name] = {"ms": ms, "GBps": _gbps(nbytes, ms), "same_bits": same}
        print(json.dumps({"silu_rows": m, **{k: (round(v["ms"] * 1e3, 1), round(v["GBps"]),
              v["same_bits"]) for k, v in row.items() if isinstance(v, dict)}}),
              flush=True)  # fmt: skip
        rows_out.append(row)  # (x and ref are replaced next round; the closures read them)


def rotary(rows_out: list) -> None:
    """The kv part (PART 2, with the rotation) of this commit's kernel against a6971b4's
    ((token, head) rows), with a prompt's slots (consecutive within blocks, the blocks
    shuffled) and with scattered slots; then the engine's whole launch."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import rotary_a6971b4 as old

    hq, hk, d, bs = 32, 8, 128, 32
    signs = hadamard_signs(d, "cuda", torch.bfloat16)
    cs = torch.randn(8192, d, device="cuda")
    for t in (2048, 16384):
        qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 8192, (t,), device="cuda")
        blocks = t // bs + 1
        tok = torch.arange(t, device="cuda")
        layouts = {
            "prompt": torch.randperm(blocks, device="cuda")[tok // bs] * bs + tok % bs,
            "scattered": torch.randperm(blocks * bs, device="cuda")[:t],
        }
        ks = torch.tensor([0.05, 0.05], device="cuda")
        q_out = torch.empty(t, hq, d, dtype=qkv.dtype, device="cuda")
        kv_bytes = t * hk * d * 2 * 2 + t * hk * d * 2
        row: dict = {"tokens": t, "kv_bytes": kv_bytes}
        for lay, slots in layouts.items():
            caches = {}
            for name, mod, progs in (("new", rt, hk * triton.cdiv(t, 64)),
                                     ("old", old, triton.cdiv(t * hk, 64))):  # fmt: skip
                cache = torch.zeros(2, blocks, bs, hk, d, device="cuda",
                                    dtype=torch.float8_e4m3fn)  # fmt: skip

                def fn(mod=mod, progs=progs, cache=cache, slots=slots):
                    mod._launch((progs,), 2, qkv, pos, cs, slots, q_out, cache, ks, signs, d,
                                64, True, True, False)  # fmt: skip

                fn()
                caches[name] = cache
                ms = median_cuda_ms(fn, 20)
                row[f"kv_{name}_{lay}"] = {"ms": ms, "GBps": _gbps(kv_bytes, ms)}
            row[f"same_bits_{lay}"] = bool(
                torch.equal(caches["new"].view(torch.uint8), caches["old"].view(torch.uint8))
            )
        cache = torch.zeros(2, blocks, bs, hk, d, device="cuda", dtype=torch.float8_e4m3fn)
        slots = layouts["prompt"]
        row["engine_prompt_ms"] = median_cuda_ms(
            lambda: rt.rotary_write_kv_triton(qkv, pos, cs, cache, slots, hq, hk, d, ks, signs)
        )
        print(json.dumps({"rotary": row}), flush=True)
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
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["silu", "rotary", "rmsnorm"]
    for part in parts:  # e.g. OUT.json rotary
        {"silu": silu, "rotary": rotary, "rmsnorm": rmsnorm}[part](out[part])
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
