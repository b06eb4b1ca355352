"""Experiment (H200): how fast can one kernel read a projection's packed int4 weights at
all? For each Llama-3.1-8B projection (and the int4 head), a buffer of the same bytes as
its packed words, scales and zeros (``_wq_weights``, group 128) is read by a plain
streaming kernel: contiguous 16-byte loads, U tiles in flight per step, on a persistent
grid (1-8 programs per SM) or one tile group per program, every word folded into one
value per program so that no load is dropped. Timed as the projections are
(``time_per_call_ms``: a CUDA graph over copies larger than L2), against the tuned int4
kernel's one-row times from ``int4_many_rows.py`` (the file given, if any).

The question it answers: at batch 1 the int4 engine's projections read 4.0 GB a step at
2.6 TB/s, and 2.5x bf16 needs about 3.1. If this ceiling is near 3.1 for the small
shapes, the target needs a near-ideal access pattern; if well above, the kernels' own
work is what to cut.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_stream_ceiling.py OUT.json
[MANY_ROWS.json]``; ``--check`` runs the kernel once under the interpreter (CPU)."""

import itertools
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _stream(ptr, out_ptr, n_words, BLOCK: tl.constexpr, U: tl.constexpr,
            STATIC_ITERS: tl.constexpr = 0):  # fmt: skip
    """Program p folds (xor) tile groups p, p + P, ... of U tiles of BLOCK int32 words
    (``STATIC_ITERS``: a compile-time trip count, for the interpreter's check)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.int32)
    if STATIC_ITERS > 0:
        for j in range(0, STATIC_ITERS):
            acc = _fold(ptr, acc, pid + j * nprog, n_words, BLOCK, U)
    else:
        for gi in range(pid, tl.cdiv(n_words, BLOCK * U), nprog):
            acc = _fold(ptr, acc, gi, n_words, BLOCK, U)
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _fold(ptr, acc, gi, n_words, BLOCK: tl.constexpr, U: tl.constexpr):
    for u in tl.static_range(U):  # U independent loads before their folds
        offs = (gi * U + u) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n_words, other=0)
    return acc


@triton.jit
def _xor(a, b):
    return a ^ b


def stream(buf: torch.Tensor, out: torch.Tensor, cfg: dict, static: bool = False) -> None:
    n = buf.numel()
    groups = triton.cdiv(n, cfg["BLOCK"] * cfg["U"])
    grid = groups if cfg["per_sm"] == 0 else min(groups, cfg["per_sm"] * cfg["sms"])
    iters = triton.cdiv(groups, grid) if static else 0
    _stream[(grid,)](buf, out, n, BLOCK=cfg["BLOCK"], U=cfg["U"], STATIC_ITERS=iters,
                     num_warps=cfg["num_warps"])  # fmt: skip


def check() -> None:
    """Under the interpreter: each program's value is the xor of its words."""
    buf = torch.randint(-(2**31), 2**31 - 1, (10_000,), dtype=torch.int32)
    out = torch.zeros(4, dtype=torch.int32)
    cfg = {"BLOCK": 256, "U": 2, "num_warps": 4, "per_sm": 1, "sms": 4}
    stream(buf, out, cfg, static=True)
    want = []
    for p in range(4):
        words = torch.cat([buf[g * 512 : (g + 1) * 512] for g in range(p, 20, 4)])
        v = 0
        for w in words.tolist():
            v ^= w
        want.append(v)
    assert out.tolist() == want, (out.tolist(), want)
    print("check passed")


def main() -> None:
    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES, rotation_copies, time_per_call_ms
    from kiln.bench.quant_bench import _wq_weights

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel_us = {}
    if len(sys.argv) > 2:  # the tuned int4 kernel's one-row times
        with open(sys.argv[2]) as f:
            many_rows = json.load(f)
        for r in many_rows["rows"]:
            if r["m"] == 1 and r["top3"]:
                kernel_us[r["shape"]] = r["top3"][0]["ms"] * 1e3
    res = {"note": __doc__.split("\n\n")[0], "sms": sms, "shapes": []}
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        p, s, z = _wq_weights(n, k, True, 128, 1)[0]
        nbytes = p.numel() * p.element_size() + s.numel() * s.element_size()
        nbytes += z.numel() * z.element_size()
        words = -(-nbytes // 64) * 16  # whole 64-byte runs: n_words divisible by 16, so
        # Triton specializes on it and the masked loads stay 16-byte vectors
        bufs = [torch.randint(0, 2**31 - 1, (words,), dtype=torch.int32, device="cuda")
                for _ in range(rotation_copies(words * 4))]  # fmt: skip
        del p, s, z
        out = torch.zeros(8 * sms * 4, dtype=torch.int32, device="cuda")
        rows = []
        for block, u, nw, per_sm in itertools.product((2048, 4096), (1, 2, 4), (4, 8),
                                                      (0, 1, 2, 4, 8)):  # fmt: skip
            cfg = {"BLOCK": block, "U": u, "num_warps": nw, "per_sm": per_sm, "sms": sms}
            ms = time_per_call_ms(lambda b, c=cfg, o=out: stream(b, o, c), bufs, reps=7)
            rows.append({**cfg, "us": ms * 1e3, "tbps": nbytes / (ms * 1e-3) / 1e12})
        rows.sort(key=lambda r: r["us"])
        best = rows[0]
        row = {"shape": name, "n": n, "k": k, "bytes": nbytes, "best": best, "top5": rows[:5],
               "int4_kernel_us": kernel_us.get(name)}  # fmt: skip
        res["shapes"].append(row)
        ref = kernel_us.get(name)
        print(f"{name}: {nbytes / 1e6:.1f} MB, stream {best['us']:.2f} us "
              f"({best['tbps']:.2f} TB/s; {best})"
              + (f", int4 kernel {ref:.2f} us ({nbytes / ref / 1e6:.2f} TB/s)" if ref else ""),
              flush=True)  # fmt: skip
        del bufs
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        check()
    else:
        main()
