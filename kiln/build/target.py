"""The build target: which device kind, GPU and software an engine is built for."""

from __future__ import annotations

from typing import Any

import torch

from kiln.errors import ConfigError

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device='cuda' was asked for but torch sees no CUDA device on this machine; "
            "use --device cpu (or device='cpu')."
        )
    return device


def describe_target(device: str) -> dict[str, Any]:
    """Facts about ``device`` ("cpu" or "cuda") that an engine is tied to."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    target: dict[str, Any] = {
        "device": device,
        "gpu_name": None,
        "compute_capability": None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
    }
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        target["gpu_name"] = torch.cuda.get_device_name()
        target["compute_capability"] = f"{major}.{minor}"
    return target


def dtype_supported(dtype: str, target: dict[str, Any]) -> str | None:
    """None when ``target`` can run ``dtype``, else the reason it cannot."""
    cc = target.get("compute_capability")
    if target["device"] == "cuda" and dtype == "bfloat16" and cc and float(cc) < 8.0:
        return f"bfloat16 needs compute capability >= 8.0 and this GPU has {cc}"
    return None


def resolve_dtype(requested: str, checkpoint_dtype: str, device: str) -> str:
    """``auto``: float32 on the CPU (the reference path), the checkpoint's half precision on a
    GPU (float32 checkpoints run in bfloat16)."""
    if requested != "auto":
        return requested
    if device == "cpu":
        return "float32"
    return "float16" if checkpoint_dtype == "float16" else "bfloat16"
