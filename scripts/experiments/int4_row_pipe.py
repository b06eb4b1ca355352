"""Experiment (H200, not yet run): the one-row int4 Gluon kernel with its weight words
streamed through shared memory by ``cp.async`` (a ring of ``STAGES`` tiles), so that a
program computes one tile while the next ones are in flight.

Why: the engine kernel (``kiln.kernels.wq_gluon``) takes about the sum of its loads' time
and its arithmetic's (``results/2026-12-01-h200-int4-row-stream.json``: 54.1 us a layer for
the 32-layer chain in run 4 against 35.2 us for the four shapes' loads alone in run 1;
gate_up 24.2 against 15.8 us).
Its programs start together, all load, then all compute, so memory idles while they
compute. Register prefetch (that file's runs 1 and 3) cost registers and was slower;
``cp.async`` lands the words in shared memory without holding registers. Each thread
copies exactly the words it later reads (the copy's pointer tensor and the shared-memory
load share one layout), so ``wait_group`` alone orders them: no barrier.

The grid is persistent (at most ``PROGRAMS`` programs) and walks (column tile, K tile)
steps, so the ring stays full across tile boundaries. Scales and zeros (``SZ_AHEAD``):
loaded at the step, or one step ahead in registers. The arithmetic is the engine
kernel's (``wq_gluon._step``): outputs match it bit for bit at the same K tiles; every
configuration is checked against ``wq_linear_ref`` (largest error under 2 % of the largest
output, as in int4_row_stream.py).

Usage: ``PYTHONPATH=. python scripts/experiments/int4_row_pipe.py OUT.json`` (GPU: per
shape sweep checked against the reference, then the four projections of 32
layers in one CUDA graph); ``... --compile`` compiles for sm_90 here and prints spills."""

import json
import re
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from kiln.kernels.wq_gluon import _step

sys.path.insert(0, str(Path(__file__).parent))
G = 128


@gluon.jit
def _rows_k0(s, pid, nprog, n_kt, rn, N, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """Step ``s``'s weight rows (past N: row N - 1) and first K element."""
    t = pid + (s // n_kt) * nprog
    return gl.minimum(t * BLOCK_N + rn, N - 1), (s % n_kt) * BLOCK_K


@gluon.jit
def _copy_step(smem, w_ptr, s, pid, nprog, n_kt, rn, wc, N, stride_wn, STAGES: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
    """Start the copy of step ``s``'s words (BLOCK_N, C, 4) into ring slot s % STAGES."""
    rows, k0 = _rows_k0(s, pid, nprog, n_kt, rn, N, BLOCK_N, BLOCK_K)
    r3 = gl.expand_dims(gl.expand_dims(rows, 1), 2).to(gl.int64)
    ptrs = w_ptr + r3 * stride_wn + k0 // 8 + gl.expand_dims(wc, 0)
    async_copy.async_copy_global_to_shared(smem.index(s % STAGES), ptrs,
                                           eviction_policy="evict_first")  # fmt: skip


@gluon.jit
def _sz(s_ptr, z_ptr, s, pid, nprog, n_kt, rn, cg, N, stride_sn, BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
    """Step ``s``'s scales and zeros (BLOCK_N, C)."""
    rows, k0 = _rows_k0(s, pid, nprog, n_kt, rn, N, BLOCK_N, BLOCK_K)
    idx = gl.expand_dims(rows, 1) * stride_sn + (cg + k0) // GROUP
    return gl.load(s_ptr + idx), gl.load(z_ptr + idx)


@gluon.jit
def _pipe_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, n_kt, stride_wn, stride_sn, magic,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP: gl.constexpr,
                 NW: gl.constexpr, STAGES: gl.constexpr, SZ_AHEAD: gl.constexpr):  # fmt: skip
    """x: (K/2,) int32 bfloat16 pairs; w: (N, K/8) int32 words; scale float32, zero uint8
    (N, K/GROUP); n_kt = K / BLOCK_K. Program p takes column tiles p, p + P, ..."""
    P: gl.constexpr = gl.BlockedLayout([BLOCK_N, 1, 4], [1, 32, 1], [1, NW, 1], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(2, P)
    S0: gl.constexpr = gl.SliceLayout(0, P)
    C: gl.constexpr = BLOCK_K // 32
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, C, 4], SL)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    steps = (gl.cdiv(N, BLOCK_N) - pid + nprog - 1) // nprog * n_kt
    rn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S2))
    c0 = gl.arange(0, C, layout=gl.SliceLayout(1, S0))
    wc = gl.expand_dims(c0, 1) * 4 + gl.expand_dims(gl.arange(0, 4, gl.SliceLayout(0, S0)), 0)
    cg = gl.expand_dims(gl.arange(0, C, layout=gl.SliceLayout(0, S2)) * 32, 0)
    for i in gl.static_range(STAGES - 1):  # the ring's first tiles
        if i < steps:
            _copy_step(smem, w_ptr, i, pid, nprog, n_kt, rn, wc, N, stride_wn, STAGES,
                       BLOCK_N, BLOCK_K)  # fmt: skip
        async_copy.commit_group()
    sc, zp = _sz(s_ptr, z_ptr, 0, pid, nprog, n_kt, rn, cg, N, stride_sn, BLOCK_N, BLOCK_K,
                 GROUP)  # fmt: skip
    acc = gl.zeros([BLOCK_N, C], gl.float32, S2)
    for s in range(steps):
        if s + STAGES - 1 < steps:  # the slot read at step s - 1, by this very thread
            _copy_step(smem, w_ptr, s + STAGES - 1, pid, nprog, n_kt, rn, wc, N, stride_wn,
                       STAGES, BLOCK_N, BLOCK_K)  # fmt: skip
        async_copy.commit_group()
        if not SZ_AHEAD:
            sc, zp = _sz(s_ptr, z_ptr, s, pid, nprog, n_kt, rn, cg, N, stride_sn, BLOCK_N,
                         BLOCK_K, GROUP)  # fmt: skip
        async_copy.wait_group(STAGES - 1)  # step s's words have landed
        wd = smem.index(s % STAGES).load(P)
        kt = s % n_kt
        acc += _step(wd, sc, zp, x_ptr, kt * BLOCK_K, magic, C, NW, S0)
        if SZ_AHEAD:
            s1 = gl.minimum(s + 1, steps - 1)
            sc, zp = _sz(s_ptr, z_ptr, s1, pid, nprog, n_kt, rn, cg, N, stride_sn, BLOCK_N,
                         BLOCK_K, GROUP)  # fmt: skip
        if kt == n_kt - 1:
            offs = (pid + (s // n_kt) * nprog) * BLOCK_N + rn
            y = gl.sum(acc, axis=1)
            gl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=offs < N)
            acc = gl.zeros([BLOCK_N, C], gl.float32, S2)
    async_copy.wait_group(0)


def run_pipe(x, w, s, z, cfg, out=None):
    k = x.shape[1]
    n = w.shape[0]
    bn, bk, nw = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    grid = min(triton.cdiv(n, bn), cfg["PROGRAMS"])
    _pipe_kernel[(grid,)](
        x.view(torch.int32), w.view(torch.int32), s, z, out, n, k // bk, w.shape[1] // 4,
        s.stride(0), 0x43000000, BLOCK_N=bn, BLOCK_K=bk, GROUP=G, NW=nw,
        STAGES=cfg["STAGES"], SZ_AHEAD=cfg["SZ_AHEAD"], num_warps=nw,
    )  # fmt: skip
    return out


def _cfgs(k: int, sms: int) -> list[dict]:
    out = []
    for bn, bk, nw in ((8, 1024, 1), (8, 2048, 2), (8, 2048, 1), (4, 2048, 2), (8, 4096, 2),
                       (16, 1024, 1)):  # fmt: skip
        if k % bk:
            continue
        for stages in (2, 3, 4):
            if stages * bn * bk // 2 > 64 * 1024:  # shared memory per program
                continue
            for per_sm in (2, 4, 8):
                for ahead in (False, True):
                    out.append({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw,
                                "STAGES": stages, "PROGRAMS": per_sm * sms,
                                "SZ_AHEAD": ahead})  # fmt: skip
    return out


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.tools.disasm import get_sass

    sig = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
           "out_ptr": "*bf16", "N": "i32", "n_kt": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "magic": "i32"}  # fmt: skip
    seen = set()
    for cfg in _cfgs(14336, 132):
        key = (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["STAGES"], cfg["SZ_AHEAD"])
        if key in seen:
            continue
        seen.add(key)
        const = {"BLOCK_N": key[0], "BLOCK_K": key[1], "GROUP": G, "NW": key[2],
                 "STAGES": key[3], "SZ_AHEAD": key[4]}  # fmt: skip
        div = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 7, 8)}
        src = GluonASTSource(fn=_pipe_kernel, signature=sig | {c: "constexpr" for c in const},
                             constexprs=const, attrs=div)  # fmt: skip
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": key[2]})
        sass = get_sass(ck.asm["cubin"])
        print(const, "local stores", len(re.findall(r"\bSTL", sass)),
              "cp.async", len(re.findall(r"\bLDGSTS", sass)),
              "shared loads", len(re.findall(r"\bLDS", sass)),
              "global loads", len(re.findall(r"\bLDG", sass)),
              "shared bytes", ck.metadata.shared, flush=True)  # fmt: skip


def _sweep(name: str, n: int, k: int, sms: int) -> dict:
    from int4_row_stream import _weights

    from kiln.bench.gemv_bench import rotation_copies, time_per_call_ms
    from kiln.kernels import wq_gemm as wq

    ws = _weights(n, k, rotation_copies(n * k // 2))
    idx = {id(t[0]): t for t in ws}
    nbytes = n * k // 2 + n * (k // G) * 5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    eng_cfg = wq.wq_config(n, k, 1, G)
    eng_y = wq.wq_linear_triton(x, *ws[0], config=eng_cfg)
    eng_ms = time_per_call_ms(lambda p: wq.wq_linear_triton(x, *idx[id(p)], config=eng_cfg),
                              [t[0] for t in ws], reps=10)  # fmt: skip
    row = {
        "shape": name,
        "n": n,
        "k": k,
        "bytes": nbytes,
        "engine": {"us": eng_ms * 1e3, "tb_s": nbytes / eng_ms / 1e9, "config": eng_cfg},
    }
    print(name, "engine", round(eng_ms * 1e3, 2), flush=True)
    ref = wq.wq_linear_ref(x, *ws[0]).float()
    row["engine"]["rel_err"] = ((eng_y.float() - ref).abs().max() / ref.abs().max()).item()
    res = []
    for cfg in _cfgs(k, sms):
        try:
            y = run_pipe(x, *ws[0], cfg)
            same = bool(torch.equal(y, eng_y))  # bit for bit where the K tiles match
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 2e-2:
                print(name, cfg, "WRONG", err, flush=True)
                continue
            ms = time_per_call_ms(lambda p, c=cfg: run_pipe(x, *idx[id(p)], c),
                                  [t[0] for t in ws], reps=10)  # fmt: skip
        except Exception as e:
            print(name, cfg, "ERR", type(e).__name__, str(e)[:300], flush=True)
            continue
        res.append({"us": ms * 1e3, "tb_s": nbytes / ms / 1e9, "same": same, "rel_err": err,
                    "config": cfg})  # fmt: skip
    row["best"] = sorted(res, key=lambda r: r["us"])[:5]
    if row["best"]:
        b = row["best"][0]
        print(name, "pipe", round(b["us"], 2), f"{b['tb_s']:.2f} TB/s", b["config"], flush=True)
    return row


def main() -> None:
    from int4_row_stream import _graph_ms, _weights

    from kiln.bench.gemv_bench import LLAMA_8B_SHAPES
    from kiln.kernels import wq_gemm as wq

    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"shapes": [], "chain": {}}
    shapes = {k: v for k, v in LLAMA_8B_SHAPES.items() if k != "lm_head"}
    best = {}
    for name, (n, k) in shapes.items():
        row = _sweep(name, n, k, sms)
        res["shapes"].append(row)
        best[name] = row["best"][0]["config"] if row["best"] else None
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)
        torch.cuda.empty_cache()
    layers = [{nm: _weights(n, k, 1)[0] for nm, (n, k) in shapes.items()} for _ in range(32)]
    xs = {nm: torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
          for nm, (n, k) in shapes.items()}  # fmt: skip
    outs = {nm: torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            for nm, (n, k) in shapes.items()}  # fmt: skip

    def chain(pipe: bool) -> None:
        for lw in layers:
            for nm, (n, k) in shapes.items():
                if pipe and best[nm]:
                    run_pipe(xs[nm], *lw[nm], best[nm], out=outs[nm])
                else:
                    wq.wq_linear_triton(xs[nm], *lw[nm], config=wq.wq_config(n, k, 1, G))

    for label, pipe in (("engine", False), ("pipe", True)):
        ms = _graph_ms(lambda p=pipe: chain(p))
        res["chain"][label] = {"ms_32_layers": ms, "us_per_layer": ms * 1e3 / 32}
        print("chain", label, round(ms, 4), "ms", flush=True)
    res["chain"]["configs"] = best
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    compile_only() if "--compile" in sys.argv else main()
