"""The Hugging Face transformers peer: the same dataset through ``model.generate`` on the
same device and dtype, in static left-padded batches, output length forced.

The peer model is built from the same source as the kiln engine: for ``dummy:<preset>``
the transformers class of the architecture (Llama, Mistral, Qwen2) from the same config
with random weights, created directly on the device; for a Hugging Face directory
``from_pretrained``; for a GGUF file ``from_pretrained(dir, gguf_file=...)``. EOS is
disabled and ``min_new_tokens = max_new_tokens``, so every sequence generates the batch's
longest requested output; each request counts only its own requested tokens (the report
gives the tokens generated too). Requests are sorted by length before batching.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kiln.bench.datasets import BenchRequest
from kiln.config import ModelConfig
from kiln.errors import KilnError


def hf_config(cfg: ModelConfig) -> Any:
    """A transformers config of ``cfg``'s architecture with the same shapes."""
    import transformers

    cls = getattr(transformers, cfg.architecture.replace("ForCausalLM", "Config"))
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") in ("linear", "llama3"):
        rope.update(cfg.rope_scaling)
    kw: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=0.02,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=None,
        pad_token_id=0,
    )
    if cfg.architecture == "LlamaForCausalLM":
        kw["attention_bias"] = cfg.attention_bias
    if cfg.architecture == "MistralForCausalLM":
        kw["sliding_window"] = cfg.sliding_window
    return cls(**kw)


def load_peer(
    source: dict[str, str], cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """The transformers model for a kiln engine's ``manifest["source"]``."""
    import transformers

    kind, model = source["kind"], source["model"]
    if kind == "dummy":
        cls = getattr(transformers, cfg.architecture)
        with torch.device(device):
            m = cls._from_config(hf_config(cfg), dtype=dtype)
    elif kind == "hf":
        m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    elif kind == "gguf":
        p = Path(model)
        m = transformers.AutoModelForCausalLM.from_pretrained(
            p.parent, gguf_file=p.name, dtype=dtype
        )
    else:
        raise KilnError(f"--peer hf: no transformers model for a {kind!r} source.")
    m = m.to(device=device, dtype=dtype).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


@torch.no_grad()
def run_peer(
    model: torch.nn.Module,
    reqs: list[BenchRequest],
    batch_size: int,
    device: torch.device,
    progress: bool = True,
) -> dict[str, Any]:
    """Generate every request in left-padded batches of ``batch_size``; the figures."""
    if any(r.input_ids is None for r in reqs):
        raise KilnError("--peer hf needs token-id datasets (synthetic or JSONL input_ids).")
    order = sorted(reqs, key=lambda r: (r.output_tokens, r.input_tokens))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    # a warm-up batch of the first batch's shape, cut to 2 new tokens
    _generate(model, batches[0][: min(batch_size, 2)], device, cap=2)
    counted = generated = in_tok = 0
    bar = tqdm(total=len(reqs), desc="hf peer", unit="req", disable=not progress)
    _sync(device)
    t0 = time.perf_counter()
    for batch in batches:
        n_new = _generate(model, batch, device)
        generated += n_new * len(batch)
        counted += sum(min(n_new, r.output_tokens) for r in batch)
        in_tok += sum(r.input_tokens for r in batch)
        bar.update(len(batch))
    _sync(device)
    wall = time.perf_counter() - t0
    bar.close()
    return {
        "name": "hf-transformers",
        "batch_size": batch_size,
        "num_batches": len(batches),
        "num_requests": len(reqs),
        "wall_time_s": wall,
        "input_tokens": in_tok,
        "output_tokens": counted,
        "requested_output_tokens": sum(r.output_tokens for r in reqs),
        "generated_tokens": generated,
        "request_throughput": len(reqs) / wall,
        "output_tokens_per_s": counted / wall,
        "total_tokens_per_s": (counted + in_tok) / wall,
        "method": "generate(), greedy, left-padded static batches, eos off, "
        "min_new_tokens = max_new_tokens = longest output in the batch",
    }


def _generate(
    model: torch.nn.Module, batch: list[BenchRequest], device: torch.device, cap: int = 0
) -> int:
    """One ``generate`` call; returns the new tokens per row (checked for every row)."""
    width = max(r.input_tokens for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - r.input_tokens :] = torch.tensor(r.input_ids)
        mask[i, width - r.input_tokens :] = 1
    n = max(r.output_tokens for r in batch)
    n = min(n, cap) if cap else n
    out = model.generate(  # type: ignore[operator]
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    got = out.shape[1] - width
    if got != n:
        raise KilnError(f"the HF peer generated {got} tokens per row instead of {n}.")
    return got


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ratios(kiln_fig: dict[str, Any], peer_fig: dict[str, Any]) -> dict[str, float]:
    """kiln / peer for each throughput both measured."""
    keys = ("output_tokens_per_s", "total_tokens_per_s", "request_throughput")
    return {k: kiln_fig[k] / peer_fig[k] for k in keys if peer_fig.get(k)}
