"""Experiment (H200): SiLU·mul fused into the int4 gate_up projection's epilogue, to take
one kernel launch per layer out of a batch-1 decode step.

The tensor-core few-row kernel (``kiln.kernels.wq_mma``) holds rows g and g + 8 of each
sixteen-row group in the same lane. With gate_up's weight rows interleaved in blocks of
eight (gate rows 8j..8j+7, then up rows 8j..8j+7: ``interleave``), a lane holds gate and
up of the same output channel, and the epilogue writes ``silu(gate) * up`` directly (both
rounded to bfloat16 first and the product in float32, as ``activation._silu_mul_kernel``
computes it). No split K: the epilogue needs whole sums.

1. Correctness: fused against gate_up then ``silu_and_mul`` (the same bits expected) and
   against the float32 reference, at 1, 3 and 8 rows, odd sizes too.
2. A chain of 32 layers in one CUDA graph (weights of each layer its own, from HBM), PDL as
   in the engine: [gate_up, SiLU·mul, down] with gate_up split 4 (the b74f7f4 tuning's
   pick, with its reduction kernel) or unsplit, against [fused gate_up, down], at 1 and 8
   rows; a few fused configurations.

Usage: ``PYTHONPATH=. python scripts/experiments/gate_up_silu.py OUT.json``."""

import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kiln.kernels import pdl
from kiln.kernels.wq_mma import _main, _words_layout

sys.path.insert(0, str(Path(__file__).parent))
G = 128


@gluon.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                         stride_sn, stride_om, magic, R: gl.constexpr, GROUP: gl.constexpr,
                         NW: gl.constexpr, CH: gl.constexpr = 1, PF: gl.constexpr = False,
                         PDL: gl.constexpr = False):  # fmt: skip
    """Grid (N / (16 R),); w: gate_up's (N, K/8) words with rows interleaved by eight;
    out: (M, N / 2) = silu(gate) * up."""
    acc, row, t = _main(x_ptr, w_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                        K, magic, gl.program_id(0), 0, R, GROUP, NW, CH, PF, PDL)  # fmt: skip
    S: gl.constexpr = gl.SliceLayout(3, _words_layout(R, NW))
    tok = gl.expand_dims(2 * t, 0)  # (1, 32)
    rw = gl.convert_layout(gl.reshape(row, [R, 32]), gl.SliceLayout(0, S))
    col = (rw // 16) * 8 + rw % 16  # rows g < 8 of each group: gate of channel col
    _silu_store(gl.sum(acc[0], axis=0), gl.sum(acc[2], axis=0), col, tok, out_ptr, M, N,
                stride_om)  # fmt: skip
    _silu_store(gl.sum(acc[1], axis=0), gl.sum(acc[3], axis=0), col, tok + 1, out_ptr, M, N,
                stride_om)  # fmt: skip


@gluon.jit
def _silu_store(g, u, col, tok, out_ptr, M, N, stride_om):
    g = g.to(gl.bfloat16).to(gl.float32)  # gate_up's output is rounded before SiLU·mul
    u = u.to(gl.bfloat16).to(gl.float32)
    y = g / (1.0 + gl.exp(-g)) * u
    ok = (tok < M) & (col < N // 2)
    gl.store(out_ptr + tok * stride_om + col, y.to(out_ptr.dtype.element_ty), mask=ok)


def interleave(t: torch.Tensor) -> torch.Tensor:
    """Rows [gate | up] (2I first) -> blocks of eight gate rows then eight up rows."""
    i = t.shape[0] // 2
    assert i % 8 == 0
    g, u = t[:i].reshape(i // 8, 8, *t.shape[1:]), t[i:].reshape(i // 8, 8, *t.shape[1:])
    return torch.stack([g, u], 1).reshape(t.shape).contiguous()


def gate_up_silu(x, w, s, z, r=2, nw=4, ch=2, pf=False, out=None):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n // 2, dtype=x.dtype, device=x.device) if out is None else out
    _gate_up_silu_kernel[(triton.cdiv(n, 16 * r),)](
        x.view(torch.int32), w.view(torch.int32), s, z, out, m, n, k, x.stride(0) // 2,
        w.stride(0) // 4, s.stride(0), out.stride(0), 0x43004300, R=r, GROUP=k // s.shape[1],
        NW=nw, CH=ch, PF=pf, num_warps=nw, **pdl.dependent_kwargs(x),
    )  # fmt: skip
    return out


def _weights_il(n, k):
    from int4_row_stream import _weights

    w, s, z = _weights(n, k, 1)[0]
    return (w, s, z), (interleave(w), interleave(s), interleave(z))


def _check(res: dict) -> bool:
    from kiln.kernels import wq_gemm as wq
    from kiln.kernels.activation import silu_and_mul
    from kiln.kernels.wq_mma import wq4_mma

    ok = True
    for n, k in ((2 * 14336, 4096), (2 * 520, 384), (2 * 24, 256)):
        (w, s, z), (wi, si, zi) = _weights_il(n, k)
        for m in (1, 3, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = silu_and_mul(wq.wq_linear_ref(x, w, s, z).bfloat16()).float()
            for r, nw, ch, pf in ((1, 1, 1, False), (2, 4, 2, False), (4, 2, 2, True)):
                base = silu_and_mul(wq4_mma(x, w, s, z, r=r, num_warps=nw, ch=ch, pf=pf))
                y = gate_up_silu(x, wi, si, zi, r, nw, ch, pf)
                same = bool(torch.equal(y, base))
                ulps = int((y.view(torch.int16).int() - base.view(torch.int16).int()).abs().max())
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                good = ulps <= 1 and err < 2e-2  # the same bits expected; 1 ulp tolerated
                ok &= good
                res["check"].append({"n": n, "k": k, "m": m, "r": r, "nw": nw, "ch": ch,
                                     "pf": pf, "same_bits": same, "max_ulps": ulps,
                                     "rel_err": err})  # fmt: skip
                if not good:
                    print("WRONG", n, k, m, r, nw, ch, pf, same, err, flush=True)
    return ok


def main() -> None:
    from int4_row_stream import _graph_ms, _weights

    from kiln.kernels import wq_gemm as wq
    from kiln.kernels.activation import silu_and_mul
    from kiln.kernels.wq_mma import wq4_mma

    torch.manual_seed(0)
    res = {"note": __doc__.split("\n\n")[0], "check": [], "chain": {}}
    out = Path(sys.argv[1])
    if not _check(res):
        out.write_text(json.dumps(res, indent=1))
        sys.exit(1)
    i, h = 14336, 4096
    layers = [_weights_il(2 * i, h) for _ in range(32)]  # (plain, interleaved) per layer
    down = [_weights(h, i, 1)[0] for _ in range(32)]
    gate_up_cfgs = {"split4_r2_nw1_ch2": (2, 1, 4, 2), "split1_r2_nw4_ch2": (2, 4, 1, 2)}
    fused_cfgs = [(2, 4, 2, False), (2, 8, 2, False), (1, 8, 2, False), (4, 4, 2, False),
                  (2, 4, 4, False), (2, 4, 2, True), (1, 4, 4, False)]  # fmt: skip
    for m in (1, 8):
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        dcfg = wq.wq_config(h, i, m, G)

        def unfused(c, x=x, dcfg=dcfg) -> None:
            for (plain, _), dw in zip(layers, down, strict=True):
                a = silu_and_mul(wq4_mma(x, *plain, r=c[0], num_warps=c[1], split=c[2], ch=c[3]))
                wq.wq_linear_triton(a, *dw, config=dcfg)

        def fused(c, x=x, dcfg=dcfg) -> None:
            for (_, il), dw in zip(layers, down, strict=True):
                a = gate_up_silu(x, *il, *c)
                wq.wq_linear_triton(a, *dw, config=dcfg)

        for name, c in gate_up_cfgs.items():
            ms = _graph_ms(lambda c=c: unfused(c))
            res["chain"][f"unfused_{name}_m{m}"] = {"ms_32_layers": ms,
                                                    "us_per_layer": ms * 1e3 / 32}  # fmt: skip
            print("m", m, "unfused", name, round(ms * 1e3 / 32, 2), "us/layer", flush=True)
        for c in fused_cfgs:
            ms = _graph_ms(lambda c=c: fused(c))
            key = "fused_r{}_nw{}_ch{}_pf{}".format(*c)
            res["chain"][f"{key}_m{m}"] = {"ms_32_layers": ms, "us_per_layer": ms * 1e3 / 32}
            print("m", m, key, round(ms * 1e3 / 32, 2), "us/layer", flush=True)
        res["chain"][f"down_config_m{m}"] = dcfg
        out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
