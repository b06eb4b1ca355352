"""Next-token selection: greedy, or temperature / top-k / top-p sampling with a per-request
random generator (so a seeded request samples the same tokens whatever it is batched with)."""

from __future__ import annotations

import torch

from kiln.runtime.sequence import Sequence


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (set to -inf) tokens outside the top-k and outside the top-p nucleus of one row
    (vocab,); at least the most likely token always survives."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], default_generator: torch.Generator) -> None:
        self.eos = list(eos_token_ids)
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: (N, vocab) float32, one row per sequence -> one token id per sequence."""
        out: list[int] = []
        for row, seq in zip(logits, seqs, strict=True):
            p = seq.params
            if len(seq.output_token_ids) < p.min_tokens:
                banned = [t for t in [*self.eos, *p.stop_token_ids] if t < row.shape[0]]
                row = row.clone()
                row[banned] = float("-inf")
            if p.greedy:
                out.append(int(row.argmax()))
                continue
            row = filter_logits(row / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            gen = seq.generator or self.default_generator
            # Gumbel-max in its exponential form: argmax(p / E), E ~ Exp(1), is a sample of p.
            noise = torch.empty_like(probs).exponential_(generator=gen)
            out.append(int((probs / noise).argmax()))
        return out
