"""The RMSNorm kernels compiled for sm_90 without a GPU, as a batch-1 decode graph launches
them under programmatic dependent launch: the norm's weight (no kernel's output) is loaded
before ``griddepcontrol.wait``, everything else after, with one wait and no spills. Loaded
after the row's reduction, as before, it was one more memory round trip on the step's
critical path in every norm (measured on an H100: no gain from the move, 2026-12-06; the
weight likely stays in L2, since the projections stream their words with ``evict_first``).
In a process of its own: the other CPU tests run Triton's interpreter (``tests.sm90``)."""

from __future__ import annotations

import pytest

from tests import sm90

_COMPILE = """
import json
from kiln.kernels import f16_prep, rmsnorm
from tests.sm90 import compile_sm90


def split(ptx):
    head, _, tail = ptx.partition("griddepcontrol.wait")
    return {"waits": ptx.count("griddepcontrol.wait"),
            "launch_first": 0 <= ptx.find("griddepcontrol.launch_dependents") < len(head),
            "loads_before": head.count("ld.global"), "loads_after": tail.count("ld.global")}


out = []
ints = "stride_x stride_r stride_o stride_ro hidden stride_s".split()
for residual, spl in ((True, 0), (False, 0), (True, 4)):
    sig = {"x_ptr": "*fp32" if spl else "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16",
           "out_ptr": "*bf16", "r_out_ptr": "*bf16", **dict.fromkeys(ints, "i32"),
           "eps": "fp32"}
    sig = {k: sig[k] for k in ("x_ptr r_ptr w_ptr out_ptr r_out_ptr stride_x stride_r "
                               "stride_o stride_ro hidden eps stride_s").split()}
    k = compile_sm90(rmsnorm._rms_norm_kernel, sig, {"HAS_RESIDUAL": residual,
                     "BLOCK": 4096, "PDL": 2, "SPLIT": spl}, 16)
    out.append({"kernel": "rms_norm", "residual": residual, "split": spl,
                "regs": k["regs"], "stack": k["stack"], **split(k["ptx"])})
    sig = {"x_ptr": "*fp32" if spl else "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16",
           "xq_ptr": "*fp16", "sum_ptr": "*fp32", "r_out_ptr": "*bf16", "stride_x": "i32",
           "stride_r": "i32", "stride_q": "i32", "stride_ro": "i32", "hidden": "i32",
           "eps": "fp32", "stride_s": "i32"}
    k = compile_sm90(f16_prep._rms_norm_prep_kernel, sig, {"HAS_RESIDUAL": residual,
                     "BLOCK": 4096, "SLICE": 1024, "SPLIT": spl, "PDL": 2},
                     f16_prep.NORM_WARPS)
    out.append({"kernel": "rms_norm_prep", "residual": residual, "split": spl,
                "regs": k["regs"], "stack": k["stack"], **split(k["ptx"])})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return sm90.run(_COMPILE)


def test_norm_weights_load_before_the_wait(compiled: list[dict]) -> None:
    assert len(compiled) == 6
    for k in compiled:
        assert k["waits"] == 1 and k["launch_first"], k
        assert k["loads_before"] >= 1, k  # the weight
        assert k["loads_after"] >= 1, k  # x (or its partials) and the residual
        assert k["stack"] == 0, k
