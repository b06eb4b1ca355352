"""Compiling a kernel for sm_90 without a GPU (Triton's frontend and bundled ptxas), for the
tests that check in CI what only the GPU runs. ``run`` executes a script in a process of
its own (the CPU tests run Triton's interpreter, which a compile must not see); the
script calls ``compile_sm90`` and prints one JSON line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any


def compile_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                 num_warps: int, gluon: bool = False, divisible: tuple[str, ...] = (),
                 options: dict[str, Any] | None = None,
                 sass: bool = False) -> dict[str, Any]:  # fmt: skip
    """``fn`` compiled for sm_90 with ``signature`` (its non-constexpr arguments' types)
    and ``constexprs``: its PTX, Triton GPU IR and, with ``sass``, SASS (``cuobjdump
    -sass``; else None), and the registers and stack bytes a thread uses (``cuobjdump
    -res-usage``; stack bytes are spilled registers). ``divisible``: the arguments taken as
    multiples of 16, as the launcher specializes them (alignment, and so vector loads,
    follow from it). ``options``: more compile options (as a launch's keyword arguments,
    e.g. ``enable_fp_fusion``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = ASTSource(fn, signature | dict.fromkeys(constexprs, "constexpr"), constexprs, attrs)
    opts = {"num_warps": num_warps, **(options or {})}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
        asm = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                             check=True).stdout if sass else None  # fmt: skip
    regs, stack = (int(re.search(key + r":(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return {"ptx": k.asm["ptx"], "ttgir": k.asm["ttgir"], "sass": asm, "regs": regs,
            "stack": stack}  # fmt: skip


def run(script: str, *args: str, timeout: int = 900) -> list[Any]:
    """``script`` in a fresh interpreter without ``TRITON_INTERPRET`` (repo root on its
    path); the JSON of its last line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])
