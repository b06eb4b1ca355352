"""Experiment (H200): how much of the one-row int4 projections' time is DRAM. Each
Llama-3.1-8B projection at one row, with the configuration an int4-awq build picked on
2026-12-01 (``tuning.json`` of the ``int4h`` engine), timed in a CUDA graph two ways:
cold (calls rotate over weight copies larger than the 50 MB L2, as in the engine) and hot
(the same weight every call, so whatever fits stays in L2). Then a one-program-per-SM
empty Triton kernel, for the floor of one launch in a graph. If hot is far below cold,
bringing the next projection's weights into L2 while the step's small kernels run
(norms, rotary, attention) would pay; if not, the kernels are bound by their own latency.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_l2_hot.py OUT.json``."""

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))

GLUON8 = {"FMA": True, "WORDS": True, "GLUON": True, "num_warps": 2, "num_stages": 2,
          "BLOCK_N": 8, "SPLIT_K": 1}  # fmt: skip
MMA = {"MMA": True, "R": 2, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4, "CH": 2, "PF": False}
PICKS = {  # (n, k): the m=1 pick of the 2026-12-01 int4h build
    "qkv": (6144, 4096, GLUON8 | {"BLOCK_K": 2048}),
    "o": (4096, 4096, GLUON8 | {"BLOCK_K": 4096}),
    "gate_up": (28672, 4096, MMA | {"num_warps": 1}),
    "down": (4096, 14336, MMA | {"num_warps": 4}),
}


@triton.jit
def _empty(x_ptr):
    pid = tl.program_id(0)
    if pid < 0:
        tl.store(x_ptr, 0.0)


def main() -> None:
    from int4_row_stream import _graph_ms, _weights

    from kiln.bench.gemv_bench import rotation_copies, time_per_call_ms
    from kiln.kernels import wq_gemm as wq

    torch.manual_seed(0)
    res = {"note": __doc__.split("\n\n")[0], "shapes": {}}
    out = Path(sys.argv[1])
    for name, (n, k, cfg) in PICKS.items():
        ws = _weights(n, k, rotation_copies(n * k // 2))
        idx = {id(t[0]): t for t in ws}
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        packed = [t[0] for t in ws]

        def call(p, c=cfg, x=x, i=idx):
            return wq.wq_linear_triton(x, *i[id(p)], config=c)

        cold = time_per_call_ms(call, packed, 20)
        hot = time_per_call_ms(call, [packed[0]] * len(packed), 20)
        mb = (n * k // 2 + ws[0][1].numel() * 4 + ws[0][2].numel() * ws[0][2].element_size()) / 1e6
        res["shapes"][name] = {"n": n, "k": k, "config": cfg, "mb": mb, "cold_us": cold * 1e3,
                               "hot_us": hot * 1e3, "cold_tb_s": mb / cold / 1e3}  # fmt: skip
        print(name, res["shapes"][name], flush=True)
        del ws
        torch.cuda.empty_cache()
    buf = torch.zeros(1, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ms = _graph_ms(lambda: [_empty[(sms,)](buf) for _ in range(128)])
    res["empty_kernel_us"] = ms * 1e3 / 128
    print("empty kernel in a graph", res["empty_kernel_us"], "us", flush=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
