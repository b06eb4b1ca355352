"""Next-token selection for a batch of sequences, each with its own ``SamplingParams``.

One call turns the (N, V) logits of N sequences into N tokens (plus logprobs where asked):

1. raw logprobs (``log_softmax`` of the logits as given) for rows with ``logprobs`` set;
2. penalties: repetition (HF: prompt and output tokens), presence and frequency (OpenAI:
   output tokens only), from per-sequence token counts kept on the logits' device;
3. min_tokens: eos (unless ``ignore_eos``) and ``stop_token_ids`` are banned while a
   sequence has fewer than ``min_tokens`` outputs;
4. greedy rows take the argmax; the others are divided by their temperature, filtered by
   min-p, top-k and top-p (one sort for all of them) and sampled.

Every step is batched over rows except the random draws: each sampled row draws its noise
from its own ``seq.generator`` when it has one, so a seeded request gets the same tokens
whatever else shares the batch. Rows without one share the sampler's default generator."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kiln.runtime.logprobs import Logprob, logprob_dicts, prompt_logprobs
from kiln.runtime.sequence import Sequence

__all__ = ["Logprob", "SampleResult", "Sampler", "filter_logits", "prompt_logprobs"]

_NEG_INF = float("-inf")


@dataclass
class SampleResult:
    """One token per row and, per row, its logprobs dict (None unless that row's
    ``params.logprobs`` is set; then the sampled token plus the top-``logprobs`` tokens)."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


def filter_logits(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Mask (set to -inf) tokens of one row (vocab,) outside the top-k, below min-p and outside
    the top-p nucleus; at least the most likely token always survives."""
    return filter_batch(logits[None], [top_k], [top_p], [min_p])[0]


def filter_batch(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Row-wise min-p, top-k and top-p masking of (N, V) logits; returns a new tensor.

    min-p drops tokens whose probability is below ``min_p`` times the top token's (a ratio,
    so it commutes with top-k); top-k keeps the k highest (ties with the k-th kept); top-p
    then drops a token when the mass of the tokens ranked before it, renormalized over what
    min-p and top-k left, already reaches ``top_p`` (vLLM's order). Rows with every filter
    off are not sorted."""
    vocab = logits.shape[-1]
    rows = [
        i
        for i, (k, p, m) in enumerate(zip(top_k, top_p, min_p, strict=True))
        if 0 < k < vocab or p < 1.0 or m > 0.0
    ]
    if not rows:
        return logits.clone()
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    sub = logits[idx]
    srt, order = sub.sort(dim=-1, descending=True)
    probs = srt.softmax(-1)
    mp = torch.tensor([min_p[i] for i in rows], device=dev, dtype=probs.dtype)[:, None]
    drop = probs < mp * probs[:, :1]
    kk = torch.tensor([top_k[i] if 0 < top_k[i] < vocab else vocab for i in rows], device=dev)
    drop |= srt < srt.gather(1, (kk - 1)[:, None])
    # masked tokens sit at the tail of the sorted row, so it stays sorted
    probs = srt.masked_fill(drop, _NEG_INF).softmax(-1)
    tp = [top_p[i] if top_p[i] < 1.0 else float("inf") for i in rows]
    tp_t = torch.tensor(tp, device=dev, dtype=probs.dtype)[:, None]
    nucleus_drop = (probs.cumsum(-1) - probs) >= tp_t
    nucleus_drop[:, 0] = False
    drop |= nucleus_drop
    out = logits.clone()
    out[idx] = sub.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), _NEG_INF)
    return out


@dataclass
class _Counts:
    """Penalty state of one live sequence: which tokens its prompt holds and how often each
    token occurs in its output, as (V,) tensors on the logits' device, updated in O(new
    tokens) per step instead of rebuilt from the whole history."""

    ref: weakref.ref[Sequence]
    prompt_len: int
    prompt_seen: torch.Tensor  # (V,) bool
    output_counts: torch.Tensor  # (V,) float32
    num_counted: int = 0
    last_counted: int = -1  # the output token at num_counted - 1, to detect a rewrite


class Sampler:
    """Picks the next token of every sequence of a batch; see the module docstring."""

    def __init__(self, eos_token_ids: tuple[int, ...], default_generator: torch.Generator) -> None:
        self.eos = list(eos_token_ids)
        self.default_generator = default_generator
        self._counts: dict[int, _Counts] = {}  # by id(seq); entries leave with their seq

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: (N, vocab), one row per sequence (left unchanged) -> a ``SampleResult``."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(seqs)} sequences")
        params = [s.params for s in seqs]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_lp = torch.log_softmax(logits[lp_rows].float(), -1) if lp_rows else None
        logits = self.adjusted_logits(logits, seqs)

        tokens = [0] * len(seqs)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            for i, t in zip(greedy, logits[greedy].argmax(-1).tolist(), strict=True):
                tokens[i] = t
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            drawn = self._sample(logits[sampled], [seqs[i] for i in sampled])
            for i, t in zip(sampled, drawn, strict=True):
                tokens[i] = t

        out_lp: list[dict[int, Logprob] | None] = [None] * len(seqs)
        if raw_lp is not None:
            dicts = logprob_dicts(
                raw_lp, [tokens[i] for i in lp_rows], [params[i].logprobs or 0 for i in lp_rows]
            )
            for i, d in zip(lp_rows, dicts, strict=True):
                out_lp[i] = d
        return SampleResult(tokens, out_lp)

    # ---- penalties and bans ------------------------------------------------------------

    def adjusted_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """A float32 copy of (N, V) logits with penalties applied and min_tokens bans set:
        what greedy rows take the argmax of and sampled rows divide by their temperature."""
        logits = logits.float().clone()
        self._apply_penalties(logits, seqs)
        self._ban_early_stops(logits, seqs)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place on (N, V) logits, for the rows whose params have a penalty. Repetition
        first (HF: over prompt and output), then frequency and presence (OpenAI: output)."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return
        dev, vocab = logits.device, logits.shape[1]
        states = [self._state(seqs[i], vocab, dev) for i in rows]
        counts = torch.stack([st.output_counts for st in states])
        in_output = counts > 0
        seen = torch.stack([st.prompt_seen for st in states]) | in_output

        def col(name: str) -> torch.Tensor:
            vals = [float(getattr(seqs[i].params, name)) for i in rows]
            return torch.tensor(vals, device=dev, dtype=logits.dtype)[:, None]

        idx = torch.tensor(rows, device=dev)
        sub = logits[idx]
        rep = col("repetition_penalty")
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - col("frequency_penalty") * counts - col("presence_penalty") * in_output
        logits[idx] = sub

    def _state(self, seq: Sequence, vocab: int, device: torch.device) -> _Counts:
        """The sequence's counts, brought up to date with its output tokens; rebuilt when the
        cached ones belong to another object, device or vocab, or the history was rewritten."""
        out = seq.output_token_ids
        st = self._counts.get(id(seq))
        if (
            st is None
            or st.ref() is not seq
            or st.prompt_len != len(seq.prompt_token_ids)
            or st.output_counts.shape[0] != vocab
            or st.output_counts.device != device
            or st.num_counted > len(out)
            or (st.num_counted > 0 and out[st.num_counted - 1] != st.last_counted)
        ):
            prompt = [t for t in seq.prompt_token_ids if 0 <= t < vocab]
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
            key = id(seq)
            ref = weakref.ref(seq, lambda _r, k=key, d=self._counts: d.pop(k, None))
            zeros = torch.zeros(vocab, dtype=torch.float32, device=device)
            st = _Counts(ref, len(seq.prompt_token_ids), seen, zeros)
            self._counts[key] = st
        new = [t for t in out[st.num_counted :] if 0 <= t < vocab]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=device)
            st.output_counts.index_add_(0, ids, torch.ones(len(new), device=device))
        if len(out) > st.num_counted:
            st.num_counted, st.last_counted = len(out), out[-1]
        return st

    def _ban_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """min_tokens: set eos (unless ignore_eos) and stop_token_ids to -inf while too few
        tokens have been generated."""
        vocab = logits.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        for i, s in enumerate(seqs):
            p = s.params
            if len(s.output_token_ids) >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos))
            for t in banned:
                if 0 <= t < vocab:
                    rows.append(i)
                    cols.append(t)
        if rows:
            logits[rows, cols] = _NEG_INF

    # ---- sampling ----------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Temperature, filters, then one draw per row by exponential races (Gumbel-max in
        its exponential form): argmax(p / E) with E ~ Exp(1) is a sample of p."""
        dev = logits.device
        params = [s.params for s in seqs]
        temps = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
        logits = filter_batch(
            logits / temps[:, None],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
        )
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs)
        shared = []
        for j, s in enumerate(seqs):
            if s.generator is not None:
                noise[j].exponential_(generator=s.generator)
            else:
                shared.append(j)
        if len(shared) == len(seqs):
            noise.exponential_(generator=self.default_generator)
        elif shared:
            draws = torch.empty(len(shared), probs.shape[1], device=dev, dtype=probs.dtype)
            noise[shared] = draws.exponential_(generator=self.default_generator)
        # a zero draw would make 0/0 = NaN for a masked token, and argmax prefers NaN
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(-1).tolist()
