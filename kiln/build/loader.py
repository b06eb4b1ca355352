"""Load an engine directory onto a device, after checking it can run there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from kiln.build.engine_dir import check_target, read_manifest, rebuild_hint, verify_files
from kiln.build.target import DTYPE_BY_NAME, describe_target
from kiln.build.tuning import read_tuning
from kiln.checkpoint.dummy import materialize
from kiln.config import ModelConfig, QuantConfig
from kiln.errors import ConfigError, EngineLoadError
from kiln.kernels.tuning import set_tuning
from kiln.layers.attention import set_kv_rotation
from kiln.models import build_model
from kiln.quant.build import quantize_loaded
from kiln.quant.fold import fold_smoothing
from kiln.quant.layers import QuantLinear
from kiln.quant.passes import (
    compact_int4_scales,
    fuse_activation_quant,
    pad_block_weights,
    quant_shells,
    tile_f16_weights,
)


@dataclass
class LoadedEngine:
    root: Path
    manifest: dict[str, Any]
    config: ModelConfig
    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    tuning: dict[str, Any] | None = None
    """tuning.json (None for engines built before it existed: kernel defaults apply)."""

    @property
    def limits(self) -> dict[str, int]:
        return self.manifest["limits"]


def _quant_config(manifest: dict[str, Any]) -> QuantConfig:
    try:
        return QuantConfig.from_dict(manifest.get("quant") or {})
    except ConfigError as e:
        raise EngineLoadError(
            f"engine manifest has an invalid quant config ({str(e).rstrip('.')}); rebuild with "
            f"{rebuild_hint(manifest)}."
        ) from e


def load_engine(
    root: str | Path,
    device: str = "auto",
    world_size: int = 1,
    stamp_dir: Path | None = None,
) -> LoadedEngine:
    """Check every promise of the manifest, then load the weights onto ``device``
    ("auto": the kind the engine was built for, when this machine has it)."""
    root = Path(root).expanduser()
    manifest = read_manifest(root)
    if device == "auto":
        device = manifest["target"]["device"]
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"  # check_target names the mismatch
    check_target(manifest, describe_target(device), world_size)
    verify_files(root, manifest, stamp_dir)
    try:
        cfg = ModelConfig.from_dict(manifest["model"])
    except ConfigError as e:
        raise EngineLoadError(
            f"engine manifest has an invalid model config ({str(e).rstrip('.')}); rebuild with "
            f"{rebuild_hint(manifest)}."
        ) from e
    dtype = DTYPE_BY_NAME[manifest["dtype"]]
    dev = torch.device(device)
    qcfg = _quant_config(manifest)
    if manifest["weights"]["kind"] == "dummy":
        model = build_model(cfg, dtype, dev)
        materialize(model, int(manifest["weights"]["seed"]))
        if qcfg.algo is not None:
            quantize_loaded(model, qcfg, measure_errors=False)
    else:
        model = build_model(cfg, dtype, "meta")
        if qcfg.algo is not None:
            quant_shells(model, qcfg, manifest["quant"].get("report", {}).get("modules"))
        state = load_file(str(root / manifest["weights"]["ranks"][0]), device=str(dev))
        for key in [k for k in state if k.endswith(".input_perm")]:  # act-order checkpoints
            mod = model.get_submodule(key.removesuffix(".input_perm"))
            if isinstance(mod, QuantLinear):
                mod.expect_input_perm()
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            # torch lists one problem per line; the message stays one sentence.
            problems = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()] or [str(e)]
            first = problems[0].rstrip(".")
            more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
            raise EngineLoadError(
                f"engine weights do not fit the model in its manifest ({first}{more}); "
                f"rebuild with {rebuild_hint(manifest)}."
            ) from e
    model.eval()
    if qcfg.algo == "int4-awq":  # engines built before AWQ's factors were folded at build
        fold_smoothing(model, o=False)
    if qcfg.algo is not None:
        fuse_activation_quant(model)
        if dev.type == "cuda":
            pad_block_weights(model)
    # an fp8 cache whose scales the build calibrated with q and k rotated runs so too
    q = manifest.get("quant") or {}
    set_kv_rotation(
        model, q.get("kv_cache_dtype") == "fp8" and q.get("kv_rotation") == "hadamard", dtype
    )
    tuning = read_tuning(root)
    set_tuning(tuning["kernels"] if tuning else None)
    if qcfg.algo == "int4-awq" and dev.type == "cuda":  # after the tuning it reads
        tile_f16_weights(model)
    compact_int4_scales(model)
    return LoadedEngine(root, manifest, cfg, model, dev, dtype, tuning)
