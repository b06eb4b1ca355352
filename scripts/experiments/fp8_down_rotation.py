"""Experiment (CPU emulation, not an engine feature): fp8 SmolLM2 with the down
projection's input rotated by a block Hadamard (weights W·H at conversion, activations after
SiLU·mul: online, as an engine would have to) and optionally V and O rotated per head (a
change of weights only). Monkeypatches the build; the quality gate then scores it against
the equally rotated (so mathematically unchanged) unquantized model.

Usage: PYTHONPATH=. python scripts/experiments/fp8_down_rotation.py BLOCK {vo|novo} [fp8only]
(BLOCK 1 = no down rotation). Results: docs/quantization.md (block 512 +0.39 %, 256
+1.32 %, the KL unchanged: not a robust gain)."""

import sys
import tempfile
import time
from pathlib import Path

import kiln.build.builder as B
import kiln.layers.mlp as mlp
from kiln.build.builder import build_engine
from kiln.checkpoint import default_model_path
from kiln.config import BuildConfig, QuantConfig
from kiln.kernels.hadamard import hadamard_signs

BLK = int(sys.argv[1])
VO = len(sys.argv) > 2 and sys.argv[2] == "vo"
Hb = hadamard_signs(BLK) / BLK**0.5


def rot_rows(x):  # (..., I) -> (..., I) block Hadamard
    s = x.shape
    return (x.float().reshape(*s[:-1], s[-1] // BLK, BLK) @ Hb).reshape(s).to(x.dtype)


orig = mlp.silu_and_mul
mlp.silu_and_mul = lambda h: rot_rows(orig(h))
oc = B._convert_weights


def conv(*a, **k):
    st = oc(*a, **k)
    for n in list(st):
        if n.endswith("mlp.down.weight"):
            st[n] = rot_rows(st[n])  # W Hb (Hb symmetric)
    if VO:
        cfg = a[0].config
        d, hq, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        H = hadamard_signs(d) / d**0.5
        for n in list(st):
            if n.endswith("attn.qkv.weight"):
                w = st[n].float()
                v = w[(hq + hk) * d :].reshape(hk, d, -1)
                w[(hq + hk) * d :] = (H.T @ v).reshape(hk * d, -1)  # v' = v H
                st[n] = w.to(st[n].dtype)
            if n.endswith("attn.o.weight"):
                w = st[n].float()
                st[n] = (w.reshape(w.shape[0], hq, d) @ H).reshape(w.shape).to(st[n].dtype)
    return st


B._convert_weights = conv
src = str(default_model_path())
for algo in ("fp8",) if "fp8only" in sys.argv else ("none", "fp8"):
    with tempfile.TemporaryDirectory() as dd:
        t0 = time.time()
        q = QuantConfig(
            algo=None if algo == "none" else algo,
            quality_tokens=2048,
            kv_cache_dtype="fp8" if algo == "none" else None,
        )
        m = build_engine(src, Path(dd) / "e", BuildConfig(device="cpu", quant=q), progress=False)
        r = m["quant"]["quality"]
        figs = [r["ppl_increase_pct"], r["mean_kl"], r["top1_agreement"]]
        print(BLK, VO, algo, [round(f, 5) for f in figs], round(time.time() - t0), flush=True)
