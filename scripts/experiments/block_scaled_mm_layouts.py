"""Which scale layouts torch._scaled_mm takes for fp8 "block" GEMMs (1x128 activation
blocks, 128x128 weight tiles) on this GPU, and whether its results match the float32
emulation: the scales' leading dimensions padded to multiples of 4 (16 bytes) or not, and
the rows padded to 4 or 16. Writes one JSON line per case to argv[1]."""

from __future__ import annotations

import json
import sys

import torch

from kiln.kernels import quant_act as qa
from kiln.quant import formats as qf


def _col_major(t: torch.Tensor, ld_mult: int) -> torch.Tensor:
    """(R, C) float32 with stride (1, ld): ld = R rounded up to ld_mult."""
    r, c = t.shape
    ld = -(-r // ld_mult) * ld_mult
    buf = torch.zeros(c, ld, dtype=t.dtype, device=t.device)
    buf[:, :r] = t.t()
    return buf.t()[:r]


def run(m: int, n: int, k: int, pad_rows: int, ld_a: int, ld_b: int) -> dict:
    torch.manual_seed(m + n + k)
    w = torch.randn(n, k, device="cuda") * 0.02
    wq, ws = qf.quantize_fp8_block_weight(w)  # ws (N/128, K/128)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a = qa.quantize_rows(x, "fp8", group=128)
    want = qf.act_matmul_ref(a, wq, ws, None, torch.float32)
    mp = -(-m // pad_rows) * pad_rows
    aq = torch.nn.functional.pad(a.q.view(torch.uint8), (0, 0, 0, mp - m)).view(a.q.dtype)
    sa = torch.ones(mp, a.scale.shape[1], device="cuda")
    sa[:m] = a.scale
    sa = _col_major(sa, ld_a)
    # scale_b: (K/128, N/128) with stride (1, ld) where ld >= K/128
    sb = _col_major(ws.t().contiguous(), ld_b)  # (K/128, N/128) column-major, ld mult ld_b
    case = dict(m=m, n=n, k=k, pad_rows=pad_rows, ld_a=ld_a, ld_b=ld_b,
                sa_stride=list(sa.stride()), sb_stride=list(sb.stride()))  # fmt: skip
    try:
        y = torch._scaled_mm(aq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)[:m]
        torch.cuda.synchronize()
        err = float((y.float() - want).abs().max() / want.abs().max())
        case.update(ok=True, rel_err=err, match=err < 2**-6)
    except RuntimeError as e:  # cuBLAS refuses
        case.update(ok=False, error=str(e).split("\n")[0][:160])
    return case


def main() -> None:
    out = []
    for m in (1, 7, 16, 300):
        for n, k in ((384, 256), (6144, 4096), (4096, 14336)):
            for pad_rows in (1, 4, 16):
                for ld_a, ld_b in ((1, 1), (4, 1), (1, 4), (4, 4)):
                    c = run(m, n, k, pad_rows, ld_a, ld_b)
                    out.append(c)
                    print(json.dumps(c))
    with open(sys.argv[1], "w") as f:
        meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
        json.dump({**meta, "cases": out}, f, indent=1)


if __name__ == "__main__":
    main()
