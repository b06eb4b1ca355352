"""Experiment (H200): the decode attention kernel over a bfloat16 cache against the same
over an fp8 (e4m3) cache, at the batch and context sizes of the fp8 throughput runs
(Llama-3.1-8B heads: 32 query, 8 KV, 128 wide; 32-token blocks), with 1, 2 or 4 blocks per
step of the online softmax and 4 or 8 warps. Bytes counted are the
cache bytes each variant reads. Usage (GPU):
``PYTHONPATH=. python scripts/experiments/fp8kv_decode_bench.py OUT.json``."""

import functools
import json
import sys

import torch

from kiln.bench.kernels import _paged, median_cuda_ms
from kiln.kernels.decode_attention import decode_attention_triton


def main() -> None:
    torch.manual_seed(0)
    hq, hk, d, bs = 32, 8, 128, 32
    rows = []
    for ctx, batch in ((1024, 256), (1536, 880), (2048, 256), (8192, 64)):
        q, cache, meta = _paged(batch, ctx, 1, hq, hk, d, bs, torch.bfloat16)
        tok = meta.query_start_loc[:-1]
        scales = torch.tensor([0.05, 0.05], device="cuda")
        fp8 = (cache.float() / 0.05).to(torch.float8_e4m3fn)
        out = torch.empty_like(q)
        row = {"context": ctx, "batch": batch}
        for name, c, s in (("bf16", cache, None), ("fp8", fp8, scales)):
            for warps, nb in ((4, 1), (4, 2), (4, 4), (8, 2), (8, 4)):
                run = functools.partial(
                    decode_attention_triton, q, c, meta.block_tables, meta.seq_lens, tok, out,
                    d**-0.5, ctx, num_warps=warps, kv_scale=s, blocks_per_step=nb,
                )  # fmt: skip
                ms = median_cuda_ms(run)
                nbytes = batch * ctx * 2 * hk * d * c.element_size()
                row[f"{name}_w{warps}_nb{nb}"] = {"ms": ms, "tb_s": nbytes / ms / 1e9}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del cache, fp8
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
