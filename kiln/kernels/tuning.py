"""Kernel launch configurations: defaults, replaced at load by the engine's ``tuning.json``
(chosen when the engine was built for its GPU; see kiln/build/tuning.py)."""

from __future__ import annotations

import copy
from typing import Any

DEFAULTS: dict[str, dict[str, Any]] = {
    # flash-decoding: splits per sequence are chosen so that about ``target_programs``
    # programs run (two per SM on an H200's 132 SMs); KV blocks per online-softmax step
    "decode_attention": {"target_programs": 264, "num_warps": 4, "blocks_per_step": 1},
    # (optional, from the tuner) steps of at most ``max_batch`` sequences take
    # ``small_batch``'s own three keys instead: {"max_batch": 8, "target_programs": ...};
    # then ``medium_batch``'s likewise, up to its ``max_batch`` (64)
    # flash-attention prefill over the paged cache: empty = the kernel's own default for
    # the head size and dtype (kiln/kernels/prefill_attention.py)
    "prefill_attention": {},
    # skinny matmul of decode steps (kiln/kernels/gemv.py): {"N x K": {rows: config}} from
    # the tuner; shapes missing here use gemv.skinny_default_config
    "skinny_matmul": {"by_shape": {}},
    # weight-only int4 / int8 matmuls of decode steps (kiln/kernels/wq_gemm.py):
    # {"int4g128:N x K": {rows: config}} from the tuner; missing shapes use wq_default_config.
    # "f16": the same for the float16-code kernel where it won (kiln/kernels/wq_tiled.py)
    "weight_only": {"by_shape": {}, "f16": {}},
    # fp8 x fp8 skinny matmul of decode steps (kiln/kernels/fp8_gemv.py): {"N x K": {rows:
    # config or {"scaled_mm": true}}} from the tuner; missing shapes use torch._scaled_mm
    "fp8_skinny": {"by_shape": {}},
}
KEYS: dict[str, set[str]] = {
    "decode_attention": {
        "target_programs",
        "num_warps",
        "blocks_per_step",
        "small_batch",
        "medium_batch",
    },
    "prefill_attention": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"},
    "skinny_matmul": {"by_shape"},
    "weight_only": {"by_shape", "f16"},
    "fp8_skinny": {"by_shape"},
}

_active: dict[str, dict[str, Any]] = copy.deepcopy(DEFAULTS)


def tuned(kernel: str) -> dict[str, Any]:
    """The active configuration of ``kernel`` (a defaults entry overlaid with tuning.json)."""
    return _active[kernel]


def set_tuning(configs: dict[str, dict[str, Any]] | None) -> None:
    """Make ``configs`` (tuning.json's ``kernels`` object) active over the defaults; None
    restores the defaults. Unknown kernels and keys are ignored, so an engine tuned by a
    newer kiln still loads."""
    _active.clear()
    _active.update(copy.deepcopy(DEFAULTS))
    for name, cfg in (configs or {}).items():
        if name in _active:
            _active[name].update({k: v for k, v in cfg.items() if k in KEYS[name]})
