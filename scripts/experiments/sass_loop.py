"""Where the float16-code int4 kernel's main loop issues its weight loads, from its sm_90
SASS, compiled on the CPU (no GPU needed): per configuration, the loop body's length, where
in it the words' loads (``LDG.E.EF``, evict-first) sit (0 = its first instruction, 1 = its
branch back), how many register copies in the body read a register an ``LDG`` of the same
body loaded before them (each such copy waits for that load), and the registers a thread
uses. It showed (2026-12-06, 7ac592c) that with ``PF`` ptxas sinks the next iteration's
words to the end of the body and copies them into the current buffer before the branch
back, so the "double buffer" waited on every iteration (docs/quantization.md, thirty-sixth
session).

    python scripts/experiments/sass_loop.py [R,NW,CH,PF ...]   (default: five picks)
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # a compile, not the interpreter

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_INTS = ["M", "N", "K", "stride_xm", "stride_sn", "stride_om", "k_per_split", "magic"]
_SIG = {"x_ptr": "*i32", "sum_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8",
        "out_ptr": "*bf16", "part_ptr": "*fp32", **dict.fromkeys(_INTS, "i32")}  # fmt: skip
_DIV = ("x_ptr", "sum_ptr", "w_ptr", "s_ptr", "z_ptr", "out_ptr", "part_ptr", "N", "K",
        "stride_xm", "stride_sn", "stride_om", "k_per_split")  # fmt: skip


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each SASS instruction, in order."""
    return [(int(m[1], 16), m[3], m[4]) for m in _INSN.finditer(sass)]


def _regs(operand: str) -> list[int]:
    return [int(r) for r in re.findall(r"\bR(\d+)\b", operand)]


def main_loop(insns: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The longest body closed by a branch back (``BRA`` to an earlier address)."""
    best: list[tuple[int, str, str]] = []
    for i, (addr, op, args) in enumerate(insns):
        m = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if m and int(m[1], 16) < addr:
            body = [x for x in insns[: i + 1] if x[0] >= int(m[1], 16)]
            if len(body) > len(best):
                best = body
    return best


def report(sass: str) -> dict:
    body = main_loop(instructions(sass))
    n = len(body)
    loaded: dict[int, int] = {}  # register -> index of the LDG (in the body) that wrote it
    copies_of_loads = 0
    ef_at = []
    ops: dict[str, int] = {}
    for i, (_, op, args) in enumerate(body):
        base = op.split(".")[0]
        ops[base] = ops.get(base, 0) + 1
        if base == "LDG":
            dst = _regs(args.split(",")[0])[0]
            width = 4 if ".128" in op else 2 if ".64" in op else 1
            for r in range(dst, dst + width):
                loaded[r] = i
            if ".EF" in op:
                ef_at.append(round(i / max(n - 1, 1), 2))
        elif base in ("MOV", "IMAD") and (op.startswith("IMAD.MOV") or base == "MOV"):
            src = _regs(args.split(",")[-1])
            if src and src[0] in loaded:
                copies_of_loads += 1
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:8])
    return {"body": n, "ef_loads_at": ef_at, "copies_of_loads": copies_of_loads, "ops": top}


def main(cfgs: list[tuple[int, int, int, bool]]) -> list[dict]:
    from kiln.kernels import wq_f16
    from tests.sm90 import compile_sm90

    out = []
    for r, nw, ch, pf in cfgs:
        consts = {"R": r, "SPLIT_K": 1, "GROUP": 128, "NW": nw, "CH": ch, "PF": pf, "PDL": True,
                  "M1": True, "EVEN": True, "EVEN2": pf == 2}  # fmt: skip
        k = compile_sm90(
            wq_f16._wq4_f16_kernel, _SIG, consts, nw, gluon=True, divisible=_DIV, sass=True
        )
        out.append({"R": r, "NW": nw, "CH": ch, "PF": pf, "regs": k["regs"], **report(k["sass"])})
        print(json.dumps(out[-1]), flush=True)
    return out


if __name__ == "__main__":
    picks = [(2, 2, 2, True), (2, 2, 2, False), (1, 8, 2, True), (1, 4, 1, False),
             (2, 4, 2, False)]  # fmt: skip
    if len(sys.argv) > 1:
        picks = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]]
        picks = [(r, nw, ch, bool(pf)) for r, nw, ch, pf in picks]
    main(picks)
