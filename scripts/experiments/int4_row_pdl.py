"""Experiment (H200): programmatic dependent launch (PDL) between one-row int4 projections.
A CUDA graph replays 32 layers of the four Llama-3.1-8B projections (qkv, o, gate_up, down;
distinct weights, 3.7 GB, so every weight comes from DRAM), each projection's input a view of
the previous one's output, with the Gluon kernel (``kiln.kernels.wq_gluon``) launched plainly
or with PDL: then its first weight tile is loaded before it waits for the previous kernel;
PDL modes 1-3 let the next kernel start when every program has begun, has finished its loop,
or has exited.
``between`` puts a small Triton elementwise kernel (an RMSNorm stand-in, plain launch)
between projections. Outputs of the PDL chain must equal the plain chain's bit for bit.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_row_pdl.py OUT.json``."""

import json
import sys

import torch
import triton
import triton.language as tl

from kiln.kernels import wq_gluon
from kiln.kernels.wq_config import wq_default_config
from kiln.quant import formats as qf

G, LAYERS = 128, 32
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL > 0:  # the next projection may start now and load its first weight tile
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * 0.5).to(out_ptr.dtype.element_ty), mask=offs < n)


def proj(x, w, out, pdl):
    u, s, z = w
    n, k = u.shape[0], x.shape[1]
    cfg = wq_default_config(n, k, 1, G)
    common = (x, u, s, z, None, None, out, out, 1, n, k, x.stride(0), u.stride(0), s.stride(0),
              out.stride(0), k)  # fmt: skip
    wq_gluon.launch_rows((1, triton.cdiv(n, cfg["BLOCK_N"]), 1), x, u, common, cfg, G, 1, False,
                         pdl=pdl)  # fmt: skip


def chain(layers, bufs, pdl, between):
    h, qkv, o, gu, d, t = bufs
    x = h
    for lw in layers:
        if between:
            _scale_kernel[(1,)](x, t, 4096, BLOCK=4096, PDL=pdl, launch_pdl=pdl > 0)
            x = t
        proj(x, lw["qkv"], qkv, pdl)
        proj(qkv[:, :4096], lw["o"], o, pdl)
        if between:
            _scale_kernel[(1,)](o, t, 4096, BLOCK=4096, PDL=pdl, launch_pdl=pdl > 0)
        proj(t if between else o, lw["gate_up"], gu, pdl)
        proj(gu[:, :14336], lw["down"], d, pdl)
        x = d
    return d


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[reps // 2], g


def main() -> None:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        lw = {}
        for name, (n, k) in SHAPES.items():
            u, s, z = qf.quantize_int4(torch.randn(n, k, device="cuda") / k**0.5, G)
            lw[name] = (qf.pack_int4(u), s.float().contiguous(), z)
        layers.append(lw)
    dev, bf = "cuda", torch.bfloat16
    bufs = [torch.randn(1, 4096, device=dev, dtype=bf)] + [
        torch.empty(1, n, device=dev, dtype=bf) for n in (6144, 4096, 28672, 4096, 4096)]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "layers": LAYERS}  # fmt: skip
    for between in (False, True):
        outs = {}
        for pdl in (0, 1, 2, 3):
            ms, g = timed(lambda p=pdl, b=between: chain(layers, bufs, p, b))
            g.replay()
            torch.cuda.synchronize()
            outs[pdl] = bufs[4].clone()
            key = f"{'between' if between else 'projections'}_{f'pdl{pdl}' if pdl else 'plain'}"
            res[key] = {"ms": ms, "us_per_layer": ms * 1e3 / LAYERS}
            print(key, round(ms, 4), "ms", round(ms * 1e3 / LAYERS, 2), "us/layer", flush=True)
            del g
        same = all(torch.equal(outs[0], outs[p]) for p in (1, 2, 3))
        res[f"{'between' if between else 'projections'}_identical"] = same
        print("identical", same, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
