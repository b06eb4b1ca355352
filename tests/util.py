"""Helpers shared by tests."""

from __future__ import annotations

import json
import os
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kiln.build.loader import LoadedEngine
from kiln.kernels.attention import AttentionMetadata
from kiln.runtime.kv_cache import KVCache


def save_tiny_llama(
    d: Path, seed: int = 0, config: dict | None = None, **save_kwargs: object
) -> Path:
    """A tiny random Llama checkpoint saved by transformers as safetensors into ``d``
    (``config`` overrides the LlamaConfig fields)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    cfg = LlamaConfig(**(fields | (config or {})))
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True, **save_kwargs)
    return d


@torch.inference_mode()
def prefill_logits(
    engine: LoadedEngine, ids: list[int], tokens_per_block: int = 16
) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of every prompt position, one sequence, one step."""
    dev = engine.device
    n = len(ids)
    kv = KVCache(engine.config, -(-n // tokens_per_block), tokens_per_block, engine.dtype, dev)
    blocks = list(range(kv.num_blocks))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=dev),
        slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    hidden = engine.model(
        torch.tensor(ids, device=dev), torch.arange(n, device=dev), kv.layers, meta
    )
    return engine.model.compute_logits(hidden)


def report(name: str, figures: dict[str, Any]) -> None:
    """With $KILN_REPORT_DIR set (GPU runs), write measured figures as
    ``<dir>/<name>.json`` with the commit ($KILN_COMMIT), device and versions."""
    out = os.environ.get("KILN_REPORT_DIR")
    if not out:
        return
    import transformers
    import triton

    meta = {
        "name": name,
        "commit": os.environ.get("KILN_COMMIT", "unknown"),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
        },
        "figures": figures,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")


@torch.no_grad()
def tiny_random_model() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The dummy "tiny" model in float32 with N(0, 0.05) weights (seed 0), and a copy of its
    decoder projections' weights by name (what ``gptq_weights`` takes)."""
    from kiln.checkpoint.dummy import DummyCheckpoint
    from kiln.models import build_model
    from kiln.quant.stats import decoder_linears

    torch.manual_seed(0)
    model = build_model(DummyCheckpoint("tiny", {}).config, torch.float32, "cpu")
    for p in model.parameters():
        p.copy_(torch.randn_like(p) * 0.05)
    return model, {n: m.weight.detach().clone() for n, m in decoder_linears(model).items()}


def costly_sampling_params(rows: int, max_tokens: int, min_tokens: int) -> list[Any]:
    """Per-row SamplingParams with the sampler's costliest work on every row: penalties,
    top-p without top-k on 15 rows of 16 (a whole-row sort), min-p on a quarter, seeds on
    half, min_tokens banning eos and a stop token (13), 20 logprobs."""
    from kiln import SamplingParams

    pen = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2)
    return [
        SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=[13],
            temperature=0.8,
            top_p=0.9,
            top_k=50 if i % 16 == 0 else -1,
            min_p=0.05 if i % 4 == 1 else 0.0,
            seed=i if i % 2 else None,
            logprobs=20,
            **pen,
        )
        for i in range(rows)
    ]


def sampler_seq(params: Any, seed: int | None = None) -> Any:
    """A two-token sequence with ``params`` (and its sample seed) for the sampler's tests."""
    from kiln.runtime.sequence import Sequence

    return Sequence("r", [1, 2], params, 1000, sample_seed=seed)
