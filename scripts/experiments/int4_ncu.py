"""Experiment (GPU, under Nsight Compute): why the one-row int4 projections run below
their stream ceilings on the H200. Each Llama-3.1-8B projection at one row is launched with
the configurations the H200 and H100 builds picked at one row (the tensor-core kernel with and
without ZS, the Gluon word kernel), on weights cycled through copies larger than L2 as in a
decode step; only those launches are profiled (``cudaProfilerStart`` / ``Stop`` around
them, ncu's ``--profile-from-start off``). ncu's sections then say, per kernel, how busy
the issue slots and the ALU / FMA / tensor pipes were, the occupancy, and the warp stall
reasons. The arithmetic alone ("noload", 2026-12-02) took gate_up 20.6 us against 16.2 for
the loads alone, and the 18th session's SASS count is about 8 ALU-pipe instructions a
32-bit word: this tells whether the pipes or the stalls bound it.

Usage on the GPU machine (``h200_quant.sh ncu``):
``ncu --clock-control none --profile-from-start off --section ... -o REP python
scripts/experiments/int4_ncu.py OUT.json``; ``--list`` prints the cases (CPU)."""

import json
import sys
from pathlib import Path

import torch

MMA = {"MMA": True, "BLOCK_K": 128, "PF": False}
GLUON = {"FMA": True, "WORDS": True, "GLUON": True, "num_warps": 2, "num_stages": 2,
         "SPLIT_K": 1}  # fmt: skip
CASES = {  # name: (n, k, config); the H200 picks of 2026-12-02 (b6dc027) and the H100's of today
    "gate_up/mma-zs-h200": (
        28672,
        4096,
        MMA | {"R": 2, "BLOCK_N": 32, "SPLIT_K": 4, "CH": 2, "num_warps": 1, "ZS": True},
    ),
    "gate_up/mma": (
        28672,
        4096,
        MMA | {"R": 2, "BLOCK_N": 32, "SPLIT_K": 4, "CH": 4, "num_warps": 1},
    ),
    "gate_up/gluon-h100": (28672, 4096, GLUON | {"BLOCK_N": 8, "BLOCK_K": 2048}),
    "down/mma-zs-h200": (
        4096,
        14336,
        MMA | {"R": 1, "BLOCK_N": 16, "SPLIT_K": 4, "CH": 1, "num_warps": 4, "ZS": True},
    ),
    "down/gluon-h100": (4096, 14336, GLUON | {"BLOCK_N": 4, "BLOCK_K": 2048}),
    "qkv/gluon": (6144, 4096, GLUON | {"BLOCK_N": 8, "BLOCK_K": 2048}),
    "o/gluon": (4096, 4096, GLUON | {"BLOCK_N": 8, "BLOCK_K": 4096}),
}
CALLS = 3  # profiled launches a case (after two unprofiled ones that compile and warm)


def main(path: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from int4_row_stream import _weights

    from kiln.bench.gemv_bench import rotation_copies
    from kiln.kernels import wq_gemm as wq

    torch.manual_seed(0)
    rows = []
    for name, (n, k, cfg) in CASES.items():
        ws = _weights(n, k, min(8, rotation_copies(n * k // 2)))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = wq.wq_linear_ref(x, *ws[0])
        got = wq.wq_linear_triton(x, *ws[0], config=cfg)
        tol = 2**-6 * float(ref.abs().max())
        ok = torch.allclose(got.float(), ref.float(), rtol=2**-6, atol=tol)
        wq.wq_linear_triton(x, *ws[1], config=cfg)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for i in range(CALLS):
            wq.wq_linear_triton(x, *ws[(i + 2) % len(ws)], config=cfg)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        rows.append({"case": name, "n": n, "k": k, "config": cfg, "matches_reference": ok})
        print(rows[-1], flush=True)
    with open(path, "w") as f:
        json.dump({"note": __doc__.split("\n\n")[0], "calls_per_case": CALLS, "rows": rows}, f,
                  indent=1)  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:] == ["--list"]:
        print(json.dumps(CASES, indent=1))
    else:
        main(sys.argv[1])
