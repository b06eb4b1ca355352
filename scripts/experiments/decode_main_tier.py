"""Experiment (H200): which configuration decode attention's main tier (steps of more than
64 sequences) should take, timed on cases in its own range.

At a6971b4 the build picked it over three cases, 1 x 4,096, 64 x 1,024 and 512 x 256 tokens
(single calls, ``max_seq_len`` each case's context; since 2026-12-04 the "current" set below
is the in-range ``DECODE_CASES`` of kiln/build/tuning_cases.py, called without the engine's
limit here). Two of those cases fell below the tier's range, and the 2048/128 throughput run
of 2026-12-02 (0.772x TensorRT-LLM, against 0.828x at f03a598) ran an engine whose pick was
1,056 / 4 / 2 where f03a598's was 1,056 / 4 / 4. This times all 18 candidates on those cases
and on cases the throughput shapes run (800 sequences of 2,176 tokens, as 2048/128's decode
steps; 2,048 of 256, as 128/128's; 256 of 1,024), called as the engine calls the kernel
(``max_seq_len`` 4,096, the launcher's splits), over an fp8 cache, and prints both rankings.

Usage: ``PYTHONPATH=. python scripts/experiments/decode_main_tier.py OUT.json [--bf16-kv]``;
``--smoke``: a tiny model on the CPU under the interpreter (checks the script only)."""

import json
import sys
import time

import torch

IN_RANGE = ((800, 2176), (2048, 256), (256, 1024))


def main() -> None:
    from kiln.build.tuning_cases import DECODE_CANDIDATES, DECODE_CASES, _decode_case
    from kiln.checkpoint.dummy import DummyCheckpoint

    smoke = "--smoke" in sys.argv
    kv_fp8 = "--bf16-kv" not in sys.argv
    cfg = DummyCheckpoint.from_source("dummy:tiny" if smoke else "dummy:llama-3.1-8b").config
    dev = "cpu" if smoke else "cuda"
    limit = 64 if smoke else 4096
    cands = list(DECODE_CANDIDATES)
    if smoke:
        cands = cands[:2]

    def timer(fn) -> float:  # ms
        if smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from kiln.bench.kernels import median_cuda_ms

        return median_cuda_ms(fn, 10)

    res = {"note": __doc__.split("\n\n")[0], "kv_fp8": kv_fp8, "sets": {}}
    for name, shapes, lim in (("current", DECODE_CASES, None), ("in_range", IN_RANGE, limit)):
        rows = []
        for b, c in shapes:
            if smoke:
                b, c = min(b, 3), min(c, 40)
            case = _decode_case(cfg, torch.bfloat16, b, c, 16 if smoke else 32, kv_fp8,
                                device=dev, limit=lim)  # fmt: skip
            ms = [timer(lambda k=k, run=case: run(k)) for k in cands]
            rows.append({"batch": b, "ctx": c, "ms": ms})
            del case
            if not smoke:
                torch.cuda.empty_cache()
        totals = [sum(r["ms"][i] for r in rows) for i in range(len(cands))]
        order = sorted(range(len(cands)), key=totals.__getitem__)
        res["sets"][name] = {"cases": rows, "ranking": [{**cands[i], "ms": totals[i]}
                                                        for i in order]}  # fmt: skip
        print(name, [(cands[i]["target_programs"], cands[i]["num_warps"],
                      cands[i]["blocks_per_step"], round(totals[i], 4)) for i in order[:6]],
              flush=True)  # fmt: skip
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
