"""Calibration statistics: what each decoder Linear sees at its input.

``collect_input_stats`` runs the model (kiln's ``LlamaForCausalLM``, on whatever device it
is on) over token windows, one window per forward pass with a scratch paged KV cache, and
records through forward hooks, per Linear inside the decoder layers:

- ``absmax``: per input channel max |x| (K,) (SmoothQuant's activation statistic),
- ``mean_abs``: per input channel mean |x| over every row seen (K,) (AWQ's statistic),
- ``samples``: a uniform random subset (without replacement) of up to ``keep_samples``
  input rows (S, K), for AWQ's scale search,

all float32 on the CPU. Module names are ``model.named_modules()`` names, e.g.
``layers.0.attn.qkv`` (input: attn_norm output), ``layers.0.attn.o`` (attention output),
``layers.0.mlp.gate_up`` (mlp_norm output), ``layers.0.mlp.down`` (silu(gate) * up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.kernels.attention import AttentionMetadata
from kiln.layers.linear import Linear
from kiln.runtime.kv_cache import KVCache


@dataclass
class InputStats:
    """Input statistics of one Linear. All tensors float32 on the CPU."""

    absmax: torch.Tensor
    """(K,) max |x_j| over every row seen."""
    mean_abs: torch.Tensor
    """(K,) mean |x_j| over every row seen."""
    samples: torch.Tensor
    """(S, K) uniform random subset of the rows seen, S = min(keep_samples, num_rows)."""
    num_rows: int
    """How many input rows (tokens) the statistics cover."""


class _Accumulator:
    """Running statistics of one module's inputs; reservoir sampling by random priority keys
    (the ``keep`` rows with the largest uniform keys are a uniform random subset)."""

    def __init__(self, keep: int, gen: torch.Generator) -> None:
        self.keep, self.gen = keep, gen
        self.absmax: torch.Tensor | None = None
        self.abs_sum: torch.Tensor | None = None  # float64 for long runs
        self.rows = 0
        self.keys = torch.empty(0)
        self.samples: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        a = x.abs()
        amax, asum = a.amax(dim=0), a.sum(dim=0, dtype=torch.float64)
        if self.absmax is None or self.abs_sum is None:
            self.absmax, self.abs_sum = amax, asum
        else:
            self.absmax = torch.maximum(self.absmax, amax)
            self.abs_sum += asum
        self.rows += x.shape[0]
        if self.keep <= 0:
            return
        new_keys = torch.rand(x.shape[0], generator=self.gen)
        keys = torch.cat([self.keys, new_keys])
        top = torch.topk(keys, min(self.keep, keys.numel())).indices.sort().values
        n_old = self.keys.numel()
        old_idx, new_idx = top[top < n_old], top[top >= n_old] - n_old
        picked = x[new_idx.to(x.device)].cpu()
        if self.samples is not None:
            picked = torch.cat([self.samples[old_idx], picked])
        self.samples = picked
        self.keys = torch.cat([self.keys[old_idx], new_keys[new_idx]])

    def result(self) -> InputStats:
        assert self.absmax is not None and self.abs_sum is not None, "module never ran"
        k = self.absmax.numel()
        samples = self.samples if self.samples is not None else torch.empty(0, k)
        return InputStats(
            absmax=self.absmax.cpu(),
            mean_abs=(self.abs_sum / self.rows).float().cpu(),
            samples=samples,
            num_rows=self.rows,
        )


def decoder_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every Linear inside the model's decoder layers, by ``named_modules`` name."""
    return {
        name: m
        for name, m in model.named_modules()
        if name.startswith("layers.") and isinstance(m, Linear | nn.Linear)
    }


def _param(model: nn.Module) -> torch.Tensor:
    return next(model.parameters())


def make_kv_cache(model: nn.Module, max_len: int, tokens_per_block: int = 16) -> KVCache:
    """A scratch paged KV cache holding one sequence of up to ``max_len`` tokens."""
    p = _param(model)
    blocks = max(1, -(-max_len // tokens_per_block))
    return KVCache(model.config, blocks, tokens_per_block, p.dtype, p.device)


def single_sequence_metadata(
    n: int, tokens_per_block: int, device: torch.device
) -> AttentionMetadata:
    """Metadata of one step prefilling one sequence of ``n`` tokens from position 0 into
    blocks 0, 1, ... of a paged KV cache."""
    blocks = list(range(-(-n // tokens_per_block)))
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=device),
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )


@torch.inference_mode()
def prefill_hidden(model: nn.Module, ids: list[int], kv: KVCache | None = None) -> torch.Tensor:
    """(len(ids), H) final hidden states of one sequence prefilled in one step, positions
    0..n-1. ``kv`` (reused between calls) must hold at least ``len(ids)`` tokens; without it a
    scratch cache is made."""
    return forward_sequence(model, ids, kv)


def forward_sequence(model: nn.Module, ids: list[int], kv: KVCache | None = None) -> torch.Tensor:
    """``prefill_hidden`` under whatever grad mode the caller set (autograd passes)."""
    n = len(ids)
    if n == 0:
        raise ValueError("empty window")
    kv = kv if kv is not None else make_kv_cache(model, n)
    if n > kv.num_blocks * kv.tokens_per_block:
        raise ValueError(f"window of {n} tokens does not fit the KV cache")
    dev = _param(model).device
    meta = single_sequence_metadata(n, kv.tokens_per_block, dev)
    ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
    return model(ids_t, torch.arange(n, device=dev), kv.layers, meta)


@torch.inference_mode()
def collect_input_stats(
    model: nn.Module,
    windows: list[list[int]],
    modules: list[str] | None = None,
    keep_samples: int = 512,
    seed: int = 0,
) -> dict[str, InputStats]:
    """Input statistics of every decoder Linear (or only those named in ``modules``) over
    ``windows`` (each a list of token ids, run as its own sequence from position 0).
    ``seed`` fixes which rows are kept as samples."""
    if not windows:
        raise ValueError("no calibration windows")
    linears = decoder_linears(model)
    if modules is not None:
        unknown = sorted(set(modules) - set(linears))
        if unknown:
            raise KeyError(f"not decoder Linears: {unknown}")
        linears = {n: linears[n] for n in modules}
    gen = torch.Generator().manual_seed(seed)
    accs = {name: _Accumulator(keep_samples, gen) for name in linears}
    run_with_input_hooks(model, windows, linears, lambda name, x: accs[name].add(x))
    return {name: acc.result() for name, acc in accs.items()}


@torch.inference_mode()
def run_with_input_hooks(
    model: nn.Module,
    windows: list[list[int]],
    modules: dict[str, nn.Module],
    add: Callable[[str, torch.Tensor], None],
    final: str | None = None,
) -> None:
    """Run ``windows`` through ``model`` (each its own sequence from position 0), calling
    ``add(name, x)`` with the input of every module in ``modules`` at every call, and
    ``add(final, hidden)`` with each window's final hidden states (lm_head's input) when
    ``final`` is given."""

    def hook_for(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
            add(name, args[0])

        return hook

    handles = [m.register_forward_hook(hook_for(n)) for n, m in modules.items()]
    try:
        kv = make_kv_cache(model, max(len(w) for w in windows))
        for w in windows:
            hidden = prefill_hidden(model, w, kv)
            if final:
                add(final, hidden)
    finally:
        for h in handles:
            h.remove()
