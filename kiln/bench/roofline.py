"""The roofline model: how fast each recorded engine step could have run at best.

For every model step (``kiln.runtime.stats.StepRecord``) the model counts the bytes the
step must move through device memory and the floating-point operations it must do, and
takes the step's ideal time as ``max(bytes / copy bandwidth, flops / matmul rate)``, both
rates measured on the device by ``kiln.bench.ceilings``. The run's ideal time is the sum
over steps; the benchmark reports ``ideal / measured`` ("x % of roofline"), measured being
the span from the first step's start to the last step's end (host gaps included).

Per step, with ``T`` tokens computed (prefill + decode), ``S`` sequences, ``b`` bytes per
element of the engine's dtype, ``h`` hidden size, ``v`` vocabulary, ``L`` layers:

- weights, read once per step: every parameter of the layers, the final norm and the LM
  head (the embedding matrix when tied), ``b`` bytes each; an untied input embedding is
  not read whole, only its ``T`` looked-up rows (``T * h * b``);
- KV cache: read ``context_tokens * kv_bytes_per_token`` (each scheduled sequence's whole
  context after the step, new tokens included: an upper bound on what attention reads)
  plus written ``T * kv_bytes_per_token``;
- FLOPs: ``2 * layer_params * T`` for the layers' matrix products, ``2 * v * h * S`` for
  the LM head (logits only for each sequence's last new token), and attention's
  ``4 * attention_pairs * heads * head_dim`` per layer (``QK^T`` and ``PV``, a
  multiply-add being 2 operations).

Quantized engines (``QuantCosts``): the weights are the bytes the engine really holds
(quantized projections with their scales, the rest in the engine dtype), the KV cache's
bytes per element are the cache dtype's (1 for fp8), and fp8 engines' layer FLOPs run at
the measured fp8 matmul rate (the LM head and attention at the engine dtype's).

Not counted: activations (small next to weights at these batch sizes), norms, rotary,
sampling and the host's work. The fraction is therefore an upper bound on how close the
engine runs to the hardware: on a real roofline it stays at most 1 as long as the ceilings
are the device's true peaks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kiln.config import ModelConfig
from kiln.runtime.stats import StepRecord


@dataclass(frozen=True)
class ModelCosts:
    """The per-token and per-step constants of one model at one dtype."""

    weight_bytes: int  # read once per step
    embed_row_bytes: int  # per token, untied embeddings only
    kv_bytes_per_token: int
    layer_flops_per_token: int
    head_flops_per_seq: int
    attn_flops_per_pair: int
    layer_rate_factor: float = 1.0  # layer matmul rate / the engine dtype's (fp8: > 1)

    @classmethod
    def of(cls, cfg: ModelConfig, itemsize: int, kv_itemsize: int | None = None) -> ModelCosts:
        h, v = cfg.hidden_size, cfg.vocab_size
        params = cfg.num_params()
        embed = v * h
        layer_params = params - embed * (1 if cfg.tie_word_embeddings else 2) - h
        untied = not cfg.tie_word_embeddings
        kv_item = kv_itemsize or itemsize
        return cls(
            weight_bytes=(params - (embed if untied else 0)) * itemsize,
            embed_row_bytes=h * itemsize if untied else 0,
            kv_bytes_per_token=2 * cfg.num_hidden_layers * cfg.kv_size * kv_item,
            layer_flops_per_token=2 * layer_params,
            head_flops_per_seq=2 * embed,
            attn_flops_per_pair=4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers,
        )

    def step_bytes(self, r: StepRecord) -> int:
        tokens = r.num_prefill_tokens + r.num_decode_tokens
        kv = (r.context_tokens + tokens) * self.kv_bytes_per_token
        return self.weight_bytes + tokens * self.embed_row_bytes + kv

    def step_flops(self, r: StepRecord) -> int:
        tokens = r.num_prefill_tokens + r.num_decode_tokens
        return (
            self.layer_flops_per_token * tokens
            + self.head_flops_per_seq * r.num_seqs
            + self.attn_flops_per_pair * r.attention_pairs
        )

    def step_math_flops(self, r: StepRecord) -> float:
        """FLOPs in units of the engine dtype's rate (layer FLOPs scaled by their rate)."""
        tokens = r.num_prefill_tokens + r.num_decode_tokens
        layer = self.layer_flops_per_token * tokens
        return self.step_flops(r) - layer + layer / self.layer_rate_factor


@dataclass(frozen=True)
class QuantCosts:
    """What a quantized engine changes in the model: ``weight_bytes`` (all weights read
    per step, untied input embedding excluded), ``kv_itemsize`` and the layer matmul rate
    over the engine dtype's. Built by the benchmark from the loaded engine."""

    weight_bytes: int
    kv_itemsize: int
    layer_rate_factor: float = 1.0
    label: str = ""


def roofline(
    cfg: ModelConfig,
    steps: list[StepRecord],
    itemsize: int,
    bandwidth_bytes_per_s: float,
    matmul_flops_per_s: float,
    quant: QuantCosts | None = None,
) -> dict[str, Any]:
    """The run's ideal time, measured time and their ratio, with the totals behind them."""
    if not steps:
        raise ValueError("no steps were recorded; set llm.core.step_log = [] before the run")
    costs = ModelCosts.of(cfg, itemsize, quant.kv_itemsize if quant else None)
    if quant is not None:
        costs = dataclasses.replace(
            costs, weight_bytes=quant.weight_bytes, layer_rate_factor=quant.layer_rate_factor
        )
    ideal = mem_bound = 0.0
    total_bytes = total_flops = 0
    for r in steps:
        b, f = costs.step_bytes(r), costs.step_flops(r)
        t_mem = b / bandwidth_bytes_per_s
        t_math = costs.step_math_flops(r) / matmul_flops_per_s
        ideal += max(t_mem, t_math)
        mem_bound += t_mem >= t_math
        total_bytes += b
        total_flops += f
    measured = steps[-1].end - steps[0].start
    busy = sum(r.end - r.start for r in steps)
    return {
        "steps": len(steps),
        "ideal_time_s": ideal,
        "measured_time_s": measured,
        "step_time_s": busy,
        "fraction": ideal / measured if measured > 0 else float("nan"),
        "memory_bound_steps": int(mem_bound),
        "bytes": total_bytes,
        "flops": total_flops,
        "achieved_bandwidth_bytes_per_s": total_bytes / measured if measured > 0 else 0.0,
        "achieved_flops_per_s": total_flops / measured if measured > 0 else 0.0,
        "bandwidth_bytes_per_s": bandwidth_bytes_per_s,
        "matmul_flops_per_s": matmul_flops_per_s,
        "model": "bytes = weights + KV read (context) + KV written; flops = 2*layer_params*T "
        "+ 2*vocab*hidden*S + 4*pairs*heads*head_dim*layers (kiln/bench/roofline.py)",
        "quantization": dataclasses.asdict(quant) if quant else None,
    }
