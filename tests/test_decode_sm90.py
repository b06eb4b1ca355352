"""Decode attention compiled for sm_90 without a GPU (Triton's frontend and bundled ptxas):
the kernels as a batch-1 CUDA graph launches them under programmatic dependent launch,
with and without reading the first chunk before the wait, over bf16 and fp8 caches. Each
compiles with one ``griddepcontrol.wait`` and no spilled registers, so a change to them is
checked in CI before it reaches the GPU. In a process of its own: the other CPU tests run
Triton's interpreter (``tests.sm90``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_COMPILE = """
import json
from kiln.kernels import decode_attention as da
from tests.sm90 import compile_sm90


def build(fn, sig, consts):
    k = compile_sm90(fn, sig, consts, 4)
    return {"waits": k["ptx"].count("griddepcontrol.wait"), "regs": k["regs"],
            "stack": k["stack"]}


out = []
ints = ("stride_qt stride_qh stride_kind stride_kb stride_kt stride_kh stride_bt "
        "window").split()
for fp8 in (False, True):
    for prefetch in (0, 1):
        sig = {"q_ptr": "*bf16", "kv_ptr": "*fp8e4nv" if fp8 else "*bf16", "bt_ptr": "*i32",
               "lens_ptr": "*i32", "tok_ptr": "*i64", "acc_ptr": "*fp32", "ml_ptr": "*fp32",
               "ks_ptr": "*fp32", "out_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32",
               "scale": "fp32", **dict.fromkeys(ints, "i32")}
        consts = {"G": 4, "G_PAD": 16, "D": 128, "BS": 32, "NB": 1, "HAS_WINDOW": False,
                  "CHUNKS_PER_SPLIT": 1, "PRECISION": "tf32", "RUNTIME_SPLIT": True,
                  "FP8": fp8, "PREFETCH": prefetch, "PDL": 2}
        out.append({"fp8": fp8, "prefetch": prefetch,
                    **build(da._decode_partial, sig, consts)})
# past pdl.MAX_ROWS rows: no PDL, so no prefetch (decode_attention.prefetch_for), at
# each blocks_per_step the tuner may pick
for nb in (1, 2, 4):
    consts = {"G": 4, "G_PAD": 16, "D": 128, "BS": 32, "NB": nb, "HAS_WINDOW": False,
              "CHUNKS_PER_SPLIT": 1, "PRECISION": "tf32", "RUNTIME_SPLIT": True,
              "FP8": True, "PREFETCH": da.prefetch_for(0), "PDL": 0}
    out.append({"nb": nb, **build(da._decode_partial, sig, consts)})
    # one split: the output written by this kernel (no reduction)
    out.append({"nb": nb, "direct": True,
                **build(da._decode_partial, sig, {**consts, "DIRECT": True})})
# one split under PDL too (a short engine limit: one chunk), prefetching
consts = {"G": 4, "G_PAD": 16, "D": 128, "BS": 32, "NB": 1, "HAS_WINDOW": False,
          "CHUNKS_PER_SPLIT": 1, "PRECISION": "tf32", "RUNTIME_SPLIT": True, "FP8": True,
          "PREFETCH": 1, "PDL": 2, "DIRECT": True}
out.append({"direct": True, **build(da._decode_partial, sig, consts)})
sig = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "tok_ptr": "*i64", "lens_ptr": "*i32",
       "out_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32", "num_heads": "i32",
       "NUM_SPLITS": "i32"}
consts = {"D": 128, "SPLITS_PAD": 16, "BS": 32, "NB": 1, "RUNTIME_SPLIT": True, "PDL": 2}
out.append({"reduce": True, **build(da._decode_reduce, sig, consts)})
print(json.dumps(out))
"""


def test_decode_kernels_compile_for_sm90() -> None:
    from tests import sm90

    got = sm90.run(_COMPILE)
    assert len(got) == 12
    for k in got:
        # under PDL every program that reads waits, once; without it none does
        assert k["waits"] == (0 if "nb" in k else 1), k
        assert k["stack"] == 0 and k["regs"] <= 255, k
    # without PDL four blocks a step fit in the registers (prefetching spilled 288 bytes),
    # with partials written or the output (one split)
    assert [(k["nb"], "direct" in k) for k in got if "nb" in k] == [
        (1, False), (1, True), (2, False), (2, True), (4, False), (4, True)]  # fmt: skip
    assert sum("direct" in k for k in got) == 4


@pytest.mark.parametrize("var", ["KILN_DECODE_PREFETCH", "KILN_DECODE_DIRECT"])
def test_prefetch_setting_is_checked(var: str) -> None:
    """``KILN_DECODE_PREFETCH`` and ``KILN_DECODE_DIRECT`` are 0 or 1; anything else stops
    the import with a ``ConfigError`` naming the variable."""
    env = {**os.environ, var: "2"}
    run = subprocess.run([sys.executable, "-c", "import kiln.kernels.decode_attention"],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode != 0
    assert f"{var}='2' is invalid" in run.stderr and "0 to 1" in run.stderr


@pytest.mark.parametrize("prefetch", [0, 1])
def test_prefetch_setting_reaches_the_kernel(prefetch: int, monkeypatch) -> None:
    """The launcher passes ``KILN_DECODE_PREFETCH`` (``PREFETCH``) to the kernel where it
    waits under PDL (mode 2) and 0 elsewhere, and the result is the reference's either way
    (the interpreter runs the prefetched chunk as the first step of each split)."""
    import torch

    from kiln.kernels import decode_attention as da

    seen = []
    real = da._decode_partial

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append(k["PREFETCH"]) or real[grid](*a, **k)

    assert da.prefetch_for(0) == da.prefetch_for(1) == 0
    monkeypatch.setattr(da, "PREFETCH", prefetch)
    assert da.prefetch_for(2) == prefetch
    # the interpreter runs without PDL, so the launch takes mode 2 from a stand-in
    monkeypatch.setattr(da, "prefetch_for", lambda mode: prefetch)
    monkeypatch.setattr(da, "_decode_partial", Spy())
    torch.manual_seed(2)
    hk, hq, d, bs = 2, 4, 16, 8
    lens = torch.tensor([1, 9, 30], dtype=torch.int32)
    kv = torch.randn(2, 12, bs, hk, d)
    tables = torch.randperm(12, dtype=torch.int32)[:12].view(3, 4)
    q = torch.randn(3, hq, d)
    out = torch.empty_like(q)
    da.decode_attention_triton(q, kv, tables, lens, torch.arange(3), out, d**-0.5, 32, None, 2)
    assert seen == [prefetch]
    ref = torch.empty_like(q)
    monkeypatch.setattr(da, "_decode_partial", real)
    monkeypatch.setattr(da, "prefetch_for", lambda mode: 1 - prefetch)
    da.decode_attention_triton(q, kv, tables, lens, torch.arange(3), ref, d**-0.5, 32, None, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
