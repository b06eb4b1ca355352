"""Experiment (H100 / H200): the tensor-core int4 kernel with float16 codes and x prepared
by its producer, to cut the arithmetic a word of codes costs.

The engine kernel (``kiln.kernels.wq_mma``) turns codes into bfloat16 ``128 + q`` pairs:
bfloat16's 7-bit mantissa holds one nibble a half without a shift, so a word takes three
shifts and four ``lop3`` (and, with ``ZS``, four ``sub.bf16x2``), and x's pairs are merged
by ``prmt`` per step. On the H200 a word of codes streams in about as few cycles as those
instructions take to issue at the occupancy the kernel reaches (issue slots 25-53 % busy,
2026-12-05 ncu), so instructions a word matter there more than on the H100.

Here the codes become float16 pairs under the exponent of 1024: ``lop3(w, 0x000F000F,
0x6400)`` gives ``1024 + q`` for nibbles 0 and 4 and ``lop3(w, 0x00F000F0, 0x6400)``
gives ``1024 + 16 q`` for nibbles 1 and 5; one shift by 8 and two more ``lop3`` give the
other four: five instructions a word. The k order inside an ``mma`` is the engine
kernel's, so the odd codes (the high nibbles, times 16) meet x's odd values: x is stored
as float16 with its odd values divided by 16 (exact, powers of two), in the order the
``mma``'s B fragments take it (no ``prmt``), and per 128-code chunk the sums of its even
values and of its (divided) odd values are stored beside it. The zero point and the
exponent come off after the chunk's ``mma`` steps: ``acc - (1024 + zero) * S_even -
(1024 + 16 zero) * S_odd``, then times the scale. No sum(x) ``mma``, no ``sub``.

The kernel is now the engine's (``kiln.kernels.wq_f16``, on the words stored tile-major:
per 16-row tile and 128-code chunk 1 KB contiguous), with its range guard. Until
2026-12-06 this script carried its own copy with a row-major variant too; the row-major
figures (1.527-1.531 ms on the H200's chain) came from that copy (commit c445080).

x's preparation is done by torch here (``prep_x``); in the engine it is the epilogue of
x's producer (``kiln.kernels.f16_prep``). ``main`` also times SiLU·mul writing it against
the engine's SiLU·mul at one row of Llama-3.1-8B's MLP, in CUDA graphs: what down's
producer pays.

Usage: ``PYTHONPATH=. python scripts/experiments/int4_mma_f16.py OUT.json`` (GPU);
``... --hot OUT.json`` times every candidate on one weight called over and over (L2-hot
where it fits: a regime where the memory outruns the kernel, as on the H200). CI compiles
the kernel for sm_90 (``tests/test_wq_f16.py``)."""

import json
import sys
from pathlib import Path

import torch
import triton

from kiln.bench.quant_bench import _F16_CANDIDATES as CANDIDATES
from kiln.kernels.f16_prep import prep_ref as prep_x  # x's layout, tested in CI
from kiln.kernels.wq_f16 import MAGIC, F16Act, _wq4_f16_kernel, tile_words, wq4_f16_ref

sys.path.insert(0, str(Path(__file__).parent))

G = 128


def emulate(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The kernel's product in float32 (``wq_f16.wq4_f16_ref`` on x prepared): (M, N)."""
    a = F16Act(*prep_x(x), torch.float32)
    return wq4_f16_ref(a, tile_words(w), s, z).float()


def run_f16(xq, sums, m, w, s, z, cfg, out=None, part=None, pdl=False):
    """(M, N) bfloat16 (or the (SPLIT_K, M, N) float32 partials) from ``prep_x``'s x; ``w``
    in ``tile_words``' order (the engine kernel's only layout)."""
    assert cfg.get("TILED", True), "the engine kernel reads tile-major words only"
    n, k = w.shape[0], w.shape[1] * 2
    split, r = cfg["SPLIT_K"], cfg["R"]
    k_per_split = triton.cdiv(k // 128, split) * 128
    out = torch.empty(m, n, dtype=torch.bfloat16, device=w.device) if out is None else out
    if part is None:
        part = torch.empty(split, m, n, dtype=torch.float32, device=w.device)
    _wq4_f16_kernel[(triton.cdiv(n, 16 * r), split)](
        xq, sums, w.view(torch.int32), s, z, out, part, m, n, k, xq.stride(0), s.stride(0),
        out.stride(0), k_per_split, MAGIC, R=r, SPLIT_K=split, GROUP=k // s.shape[1],
        NW=cfg["num_warps"], CH=cfg["CH"], PF=cfg["PF"], PDL=pdl, M1=m == 1,
        EVEN=k_per_split % (128 * cfg["num_warps"] * cfg["CH"]) == 0 and k % k_per_split == 0,
        EVEN2=False,
        num_warps=cfg["num_warps"], **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return part if split > 1 else out


# ------------------------------------------------------------------ the GPU run

TILED_SWEEP = (True,)  # the engine kernel's layout (row-major: this script at c445080)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _candidates(n, k):
    out = []
    for r, nw, split, ch, pf in CANDIDATES:
        chunks = k // 128
        if n % (16 * r) or chunks % split or (chunks // split) % (nw * ch):
            continue
        out.append({"R": r, "num_warps": nw, "SPLIT_K": split, "CH": ch, "PF": pf})
    return out


def _check() -> list:
    """Odd shapes and 1-8 tokens against the float32 reference (masked and unmasked
    paths: K of 33 chunks, N not a multiple of the tile)."""
    from kiln.kernels import wq_gemm as wq

    sys.path.insert(0, str(Path(__file__).parent))
    from int4_row_stream import _weights

    out = []
    for n, k in ((1000, 4224), (4096, 4096)):
        w, s, z = _weights(n, k, 1)[0]
        for m in (1, 3, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = wq.wq_linear_ref(x, w, s, z).float()
            for cfg in ({"R": 2, "num_warps": 2, "SPLIT_K": 1, "CH": 2, "PF": True},
                        {"R": 1, "num_warps": 4, "SPLIT_K": 3, "CH": 1, "PF": False},
                        {"R": 1, "num_warps": 8, "SPLIT_K": 2, "CH": 1, "PF": False}):  # fmt: skip
                if n % 16:  # tile-major words: whole 16-row tiles
                    continue
                wt = tile_words(w)
                y = run_f16(*prep_x(x), m, wt, s, z, cfg)
                yf = y.float().sum(0) if cfg["SPLIT_K"] > 1 else y.float()
                err = ((yf - ref).abs().max() / ref.abs().max()).item()
                out.append({"n": n, "k": k, "m": m, "config": cfg, "rel_err": err,
                            "ok": err <= 2**-6})  # fmt: skip
                print("check", n, k, m, cfg, f"{err:.2e}", flush=True)
    return out


def _sweep(name, n, k, hot=False):
    """The engine tuner's ranking at one row on this GPU, then every float16 candidate:
    its error against the float32 reference and the emulation, its time per call (``hot``:
    one weight called 64 times, so that it stays in L2 where it fits)."""
    from kiln.bench.gemv_bench import time_per_call_ms
    from kiln.bench.quant_bench import tune_weight_only, weight_only_copies
    from kiln.kernels import wq_gemm as wq
    from kiln.runtime.kernel_record import precompile

    ws = weight_only_copies(n, k, G)
    if hot:
        ws = ws[:1] * 64
    pre = precompile(lambda: tune_weight_only(n, k, 1, G, ws=ws[:1], timed=False))
    print(name, "engine precompile", {a: b for a, b in pre.items() if not isinstance(b, list)},
          flush=True)  # fmt: skip
    idx = {id(t[0]): (t[0], t[1].float().contiguous(), t[2]) for t in ws}
    tiled = {i: tile_words(t[0]) for i, t in idx.items()}  # the same words, tile-major
    ranked = tune_weight_only(n, k, 1, G, ws=ws)
    eng = [r for r in ranked if "ms" in r][:3]
    eng_mma = [r for r in ranked if "ms" in r and r["config"].get("MMA")][:3]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    xq, sums = prep_x(x)
    w0, s0, z0 = idx[id(ws[0][0])]
    ref = wq.wq_linear_ref(x, w0, s0, z0).float()
    emu = emulate(x, w0, s0, z0)
    row = {"shape": name, "n": n, "k": k, "engine_top": eng, "engine_mma_top": eng_mma,
           "f16": []}  # fmt: skip
    for label, rs in (("engine top", eng), ("engine mma top", eng_mma)):
        print(name, label, [(round(r["ms"] * 1e3, 2), r["config"]) for r in rs], flush=True)
    for cfg in [c | {"TILED": t} for t in TILED_SWEEP for c in _candidates(n, k)]:
        wt = (lambda i: (tiled[i], *idx[i][1:])) if cfg["TILED"] else (lambda i: idx[i])
        try:
            y = run_f16(xq, sums, 1, *wt(id(ws[0][0])), cfg)
            yf = y.float().sum(0) if cfg["SPLIT_K"] > 1 else y.float()
            err = ((yf - ref).abs().max() / ref.abs().max()).item()
            err_emu = ((yf - emu).abs().max() / emu.abs().max()).item()
            if not err <= 2**-6:
                print(name, cfg, "WRONG", err, err_emu, flush=True)
                row["f16"].append({"config": cfg, "wrong": err})
                continue
            part = torch.empty(cfg["SPLIT_K"], 1, n, dtype=torch.float32, device="cuda")
            out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
            ms = time_per_call_ms(
                lambda p, c=cfg, wt=wt: run_f16(xq, sums, 1, *wt(id(p)), c, out=out, part=part),
                [t[0] for t in ws], reps=10)  # fmt: skip
        except Exception as e:  # a failing candidate is reported, not fatal
            print(name, cfg, "ERR", type(e).__name__, str(e)[:300], flush=True)
            continue
        row["f16"].append({"config": cfg, "us": ms * 1e3, "rel_err": err, "rel_err_emu": err_emu})
        print(name, cfg, round(ms * 1e3, 2), "err", f"{err:.2e}", f"{err_emu:.2e}", flush=True)
    row["f16"].sort(key=lambda r: r.get("us", 1e9))
    return row


def _chain_ms(layers, xs, picks, f16, pdl):
    """The four projections of 32 layers in one CUDA graph: the engine's picks, or the
    float16 kernel's (``f16``) on x prepared once per shape."""
    from kiln.kernels import wq_gemm as wq

    sys.path.insert(0, str(Path(__file__).parent))
    from int4_row_stream import _graph_ms

    preps = {nm: prep_x(x) for nm, x in xs.items()}
    if f16:  # tile-major copies where a pick reads them
        layers = [{nm: ((tile_words(lw[nm][0]), *lw[nm][1:]) if picks[nm].get("TILED")
                        else lw[nm]) for nm in SHAPES} for lw in layers]  # fmt: skip
    outs = {nm: torch.empty(1, SHAPES[nm][0], device="cuda", dtype=torch.bfloat16) for nm in xs}
    parts = {nm: torch.empty(8, 1, SHAPES[nm][0], device="cuda") for nm in xs}

    def chain():
        for lw in layers:
            for nm in SHAPES:
                c = picks[nm]
                if f16:
                    run_f16(*preps[nm], 1, *lw[nm], c, out=outs[nm],
                            part=parts[nm][: c["SPLIT_K"]], pdl=pdl)  # fmt: skip
                else:
                    wq.wq_linear_triton(xs[nm], *lw[nm], config=c,
                                        partials=c.get("SPLIT_K", 1) > 1)  # fmt: skip

    return _graph_ms(chain)


def _producer_cost() -> dict:
    """SiLU·mul at one row of (1, 2 x 14,336): the engine's kernel against the one that
    writes the float16 kernel's x, µs per call in CUDA graphs (and the two agree)."""
    from int4_row_stream import _graph_ms

    from kiln.kernels.activation import silu_and_mul_triton
    from kiln.kernels.f16_prep import silu_mul_prep_ref, silu_mul_prep_triton

    x = torch.randn(1, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    got, want = silu_mul_prep_triton(x), silu_mul_prep_ref(x)
    same = bool(torch.equal(got[0], want[0]))
    out = {"agree_bitwise": same}
    for name, fn in (("silu_mul", lambda: silu_and_mul_triton(x)),
                     ("silu_mul_prep", lambda: silu_mul_prep_triton(x))):  # fmt: skip
        out[name + "_us"] = round(_graph_ms(lambda fn=fn: [fn() for _ in range(32)]) / 32 * 1e3, 3)
    return out


def main(path: str, hot: bool = False) -> None:
    from kiln.kernels import pdl as kpdl

    torch.manual_seed(0)
    res = {"note": __doc__.split("\n\n")[0], "device": torch.cuda.get_device_name(),
           "shapes": [], "chain": {}, "l2_hot": hot}  # fmt: skip
    if hot:  # the float16 and engine kernels with their weights in L2 (where they fit)
        for name, (n, k) in SHAPES.items():
            row = _sweep(name, n, k, hot=True)
            res["shapes"].append(row)
            top = [r for r in row["f16"] if "us" in r][:3]
            print(name, "f16 top", [(round(r["us"], 2), r["config"]) for r in top])
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
        return
    res["check"] = _check()
    res["producer"] = _producer_cost()
    print("producer", res["producer"], flush=True)
    picks = {"engine": {}, "f16-tiled": {}}
    for name, (n, k) in SHAPES.items():
        row = _sweep(name, n, k)
        res["shapes"].append(row)
        picks["engine"][name] = row["engine_top"][0]["config"]
        ok = [r for r in row["f16"] if "us" in r]
        picks["f16-tiled"][name] = next(r["config"] for r in ok if r["config"]["TILED"])
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        torch.cuda.empty_cache()
    sys.path.insert(0, str(Path(__file__).parent))
    from int4_row_stream import _weights

    layers = [{nm: _weights(n, k, 1)[0] for nm, (n, k) in SHAPES.items()} for _ in range(32)]
    xs = {nm: torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
          for nm, (n, k) in SHAPES.items()}  # fmt: skip
    pdl = kpdl.pdl(xs["qkv"])
    res["chain"]["pdl"] = pdl
    for label in ("engine", "f16-tiled") * 3:
        ms = _chain_ms(layers, xs, picks[label], label != "engine", pdl)
        res["chain"].setdefault(label, []).append(ms)
        print("chain", label, round(ms, 4), "ms", flush=True)
    res["chain"]["picks"] = picks
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--hot":
        main(sys.argv[2], hot=True)
    else:
        main(sys.argv[1])
