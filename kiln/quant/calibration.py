"""Calibration: the token ids a model is run on before quantization, and the statistics
of the activations entering each decoder-layer projection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.kernels.attention import AttentionMetadata
from kiln.quant.layers import quant_targets

DEFAULT_CALIB_TOKENS = 512

_FALLBACK_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with "
    "a single step. In 1905 Albert Einstein published four papers that changed physics.\n"
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Photosynthesis converts light energy into chemical energy stored in glucose. The "
    "mitochondria is the powerhouse of the cell. Water boils at 100 degrees Celsius at sea "
    "level. Paris is the capital of France, and Berlin is the capital of Germany.\n"
    "Q: What is 12 times 7? A: 84. Q: Name a prime number larger than 10. A: 11.\n"
    "Once upon a time, in a small village by the sea, there lived an old fisherman who told "
    "stories of storms, whales and lighthouses to anyone who would listen."
)


def _default_corpus() -> str:
    """``kiln.quant.calib.default_corpus()`` when that module exists, else a short built-in
    text (a few mixed-domain sentences, repeated as needed)."""
    try:
        from kiln.quant.calib import default_corpus  # type: ignore[import-not-found]
    except ImportError:
        return _FALLBACK_CORPUS
    return default_corpus()


def calibration_token_ids(tokenizer: Any, path: str | Path | None, n_tokens: int) -> list[int]:
    """``n_tokens`` ids of the calibration text (the file at ``path``, else the default
    corpus), tokenized without special tokens and repeated to length. Without a tokenizer
    (dummy engines) the ids are a fixed pseudo-random sequence."""
    if n_tokens < 1:
        raise ConfigError(f"calibration needs at least one token, got {n_tokens}.")
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, 256, (n_tokens,), generator=gen).tolist()
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"--calib-text {str(p)!r} is not a file; pass a UTF-8 text file.")
        text = p.read_text(encoding="utf-8", errors="replace")
    else:
        text = _default_corpus()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ConfigError("the calibration text is empty after tokenization; use another file.")
    reps = -(-n_tokens // len(ids))
    return (ids * reps)[:n_tokens]


@torch.no_grad()
def collect_activation_stats(
    model: nn.Module, ids: list[int], chunk: int = 256
) -> dict[str, dict[str, torch.Tensor]]:
    """Run ``model`` over ``ids`` (one sequence, prefilled ``chunk`` tokens at a time) and
    return, for every decoder-layer projection, the float32 statistics of its input:
    ``amax`` () max |x|, ``channel_amax`` (K,) max |x| per input channel and
    ``channel_mean_abs`` (K,) mean |x| per input channel."""
    from kiln.runtime.kv_cache import KVCache

    cfg = model.config  # type: ignore[attr-defined]
    ref = model.embed.weight  # type: ignore[attr-defined]
    dev, dtype = ref.device, ref.dtype
    stats: dict[str, dict[str, torch.Tensor]] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def fn(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].detach().float().abs().reshape(-1, args[0].shape[-1])
            cur = stats.get(name)
            cmax, csum = x.amax(dim=0), x.sum(dim=0)
            if cur is None:
                stats[name] = {"channel_amax": cmax, "channel_mean_abs": csum}
                counts[name] = x.shape[0]
            else:
                cur["channel_amax"] = torch.maximum(cur["channel_amax"], cmax)
                cur["channel_mean_abs"] = cur["channel_mean_abs"] + csum
                counts[name] += x.shape[0]

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, _, _, m in quant_targets(model)]
    try:
        n = len(ids)
        tpb = 16
        kv = KVCache(cfg, -(-n // tpb), tpb, dtype, dev)
        blocks = list(range(kv.num_blocks))
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            meta = AttentionMetadata(
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
                block_tables=torch.tensor([blocks], dtype=torch.int32, device=dev),
                slot_mapping=torch.arange(start, end, dtype=torch.int64, device=dev),
                query_start_loc_cpu=[0, end - start],
                seq_lens_cpu=[end],
            )
            model(
                torch.tensor(ids[start:end], device=dev),
                torch.arange(start, end, device=dev),
                kv.layers,
                meta,
            )
    finally:
        for h in handles:
            h.remove()
    for name, s in stats.items():
        s["channel_mean_abs"] = s["channel_mean_abs"] / counts[name]
        s["amax"] = s["channel_amax"].amax()
    return stats
