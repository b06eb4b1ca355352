"""Next-token selection for a batch of sequences, each with its own ``SamplingParams``.

One call turns the (N, V) logits of N sequences into N tokens (plus logprobs where asked):

1. raw logprobs (``log_softmax`` of the logits as given) for rows with ``logprobs`` set;
2. penalties: repetition (HF: prompt and output tokens), presence and frequency (OpenAI:
   output tokens only), from per-sequence token counts kept on the logits' device
   (``kiln.runtime.penalties``);
3. min_tokens: eos (unless ``ignore_eos``) and ``stop_token_ids`` are banned while a
   sequence has fewer than ``min_tokens`` outputs;
4. sampled rows get one keep-threshold per row from min-p, top-k and top-p
   (``kiln.runtime.filters``); then one fused pass (``kiln.kernels.sampling``) takes the
   argmax of greedy rows and draws the others: temperature, the threshold, Gumbel noise.

The noise is counter-based: a hash of the sequence's 64-bit ``sample_seed``, its number of
output tokens so far and the token id. A seeded request's sequences get ``seed + index``,
so they draw the same tokens whatever else shares the batch, on every run; the others get
a seed from the sampler's (seeded) generator when created.

Nothing waits for the device until the end: the per-step parameters go up in one transfer,
and the tokens (with the logprob rows' values) come back in one, both on a side stream
(``kiln.runtime.side_copies``). ``sample_async`` launches
the work and returns a ``PendingSample`` whose ``result()`` does that one transfer."""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field

import torch

from kiln.kernels.sampling import sample_tokens, split_seed
from kiln.runtime import side_copies
from kiln.runtime.filters import (
    FilterPlan,
    filter_batch,
    filter_logits,
    keep_thresholds,
    row_chunk,
    row_params,
)
from kiln.runtime.logprobs import Logprob, build_logprob_dicts, logprob_tensors, prompt_logprobs
from kiln.runtime.penalties import PenaltyCounts, PenaltyPlan
from kiln.runtime.sequence import Sequence

__all__ = [
    "Logprob",
    "PendingSample",
    "SampleResult",
    "Sampler",
    "filter_batch",
    "filter_logits",
    "prompt_logprobs",
]

_NEG_INF = float("-inf")
_COLS = 7  # per-row float32 parameters: inv_temp, top_k, top_p, min_p, rep, freq, pres
_PEN_FIELDS = ("slots", "fresh", "seen_slots", "seen_tokens", "count_slots", "count_tokens")


@dataclass
class SampleResult:
    """One token per row and, per row, its logprobs dict (None unless that row's
    ``params.logprobs`` is set; then the sampled token plus the top-``logprobs`` tokens)."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class PendingSample:
    """The device-side result of ``Sampler.sample_async``, already on its way to the host
    (pinned memory, one copy); ``result()`` waits for it and builds the ``SampleResult``."""

    def __init__(
        self, packed: torch.Tensor, n: int, lp_rows: list[int], top_ns: list[int], kmax: int
    ) -> None:
        self._n, self._lp_rows, self._top_ns, self._kmax = n, lp_rows, top_ns, kmax
        self.tokens_device: torch.Tensor | None = None  # (n,) int64 on the logits' device
        # on a side stream (kiln.runtime.side_copies); on the CPU a copy: the tokens'
        # buffer may be the next step's ``out``
        self._host, self._event = side_copies.start_host_copy(packed)
        self._result: SampleResult | None = None

    def ready(self) -> bool:
        """True when ``result()`` will not wait for the device."""
        return self._event is None or self._event.query()

    def result(self) -> SampleResult:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            flat = self._host.tolist()
            n = self._n
            tokens = [int(t) for t in flat[:n]]
            out: list[dict[int, Logprob] | None] = [None] * n
            if self._lp_rows:
                chosen = [tokens[i] for i in self._lp_rows]
                dicts = build_logprob_dicts(chosen, self._top_ns, self._kmax, flat[n:])
                for i, d in zip(self._lp_rows, dicts, strict=True):
                    out[i] = d
            self._result = SampleResult(tokens, out)
        return self._result


@dataclass
class _Sent:
    """``_Step.send``'s device views, all of one transfer: ``cols`` (7, N) float32, one
    row per parameter (inv_temp, top_k, top_p, min_p, rep, freq, pres: each a contiguous
    (N,) view); ``thr`` (N,) float32 -inf (the keep-threshold when nothing filters);
    ``keys`` (N, 3) int64 (seed low and high 32 bits, step); ``idx`` each index list as an
    (L,) int64 view."""

    cols: torch.Tensor
    thr: torch.Tensor
    keys: torch.Tensor
    idx: dict[str, torch.Tensor]


@dataclass
class _Step:
    """Host-side plan of one call: the per-row parameters and keys, and the index lists."""

    n: int
    rows: list[float] = field(default_factory=list)  # n * _COLS values
    keys: list[int] = field(default_factory=list)  # n * 3 values
    ints: dict[str, list[int]] = field(default_factory=dict)
    filters: FilterPlan = field(default_factory=FilterPlan)
    penalties: PenaltyPlan | None = None
    top_ns: list[int] = field(default_factory=list)

    def send(self, device: torch.device) -> _Sent:
        """Everything in one transfer (pinned on CUDA, so the copy does not wait): float32
        parameters by column and the thresholds, then int64 keys and index lists, each a
        view of the one device buffer in the dtype the kernels take (no conversion
        kernels on the device)."""
        n = self.n
        # packed on the host by the standard library (a few torch calls cost more at one row);
        # each float row padded to 16 bytes, so that every view the kernels take is aligned
        # as a fresh tensor is (Triton compiles a variant per pointer alignment)
        pad = [0.0] * (-n % 4)
        floats = array("f")
        for c in range(_COLS):
            floats.extend(self.rows[c::_COLS])
            floats.extend(pad)
        floats.extend([_NEG_INF] * n)
        floats.extend(pad)
        ints = array("q", self.keys)
        for lst in self.ints.values():
            ints.extend(lst)
        host = torch.frombuffer(bytearray(floats.tobytes() + ints.tobytes()), dtype=torch.uint8)
        if device.type == "cuda":
            host = host.pin_memory()
        fb, w = 4 * len(floats), n + len(pad)
        dev = side_copies.upload(host, device)
        f32, i64 = dev[:fb].view(torch.float32), dev[fb:].view(torch.int64)
        cols, thr = f32[: _COLS * w].view(_COLS, w)[:, :n], f32[_COLS * w : _COLS * w + n]
        idx, at, empty = {}, 3 * n, i64[:0]
        for name, lst in self.ints.items():  # most are empty: one view serves them all
            idx[name], at = (i64[at : at + len(lst)] if lst else empty), at + len(lst)
        return _Sent(cols, thr, i64[: 3 * n].view(n, 3), idx)


class Sampler:
    """Picks the next token of every sequence of a batch; see the module docstring."""

    def __init__(self, eos_token_ids: tuple[int, ...], seed: int = 0) -> None:
        self.eos = list(eos_token_ids)
        self._rng = random.Random(seed)
        self._penalties = PenaltyCounts()
        # the last read-back's event: the next step's tokens may go into the same buffer
        self._read_back: torch.cuda.Event | None = None

    def sequence_seed(self, seed: int | None, index: int = 0) -> int:
        """The ``sample_seed`` of a new sequence: ``seed + index`` (mod 2**64) for a seeded
        request, else a draw from this sampler's generator."""
        if seed is not None:
            return (seed + index) & (2**64 - 1)
        return self._rng.getrandbits(64)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: (N, vocab), one row per sequence (left unchanged) -> a ``SampleResult``."""
        return self.sample_async(logits, seqs).result()

    def sample_async(
        self, logits: torch.Tensor, seqs: list[Sequence], out: torch.Tensor | None = None
    ) -> PendingSample:
        """Launch the whole selection on the logits' device; no host synchronization.
        ``out``: an (N,) int64 device buffer the tokens are written into (the CUDA graphs'
        input of the next step), else a new tensor; ``tokens_device`` is it either way."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(seqs)} sequences")
        n, vocab = logits.shape
        step = self._plan(seqs, vocab, logits.device, sampling=True)
        sent = step.send(logits.device)
        idx = sent.idx
        raw_lp = None
        if step.top_ns:
            raw_lp = torch.log_softmax(logits[idx["lp_rows"]].float(), -1)
        x = self._adjust(logits, step, sent)
        inv_temp, thr = sent.cols[0], sent.thr
        if not step.filters.empty:
            k, p, m = sent.cols[1], sent.cols[2], sent.cols[3]
            thr = keep_thresholds(x, inv_temp, k, p, m, step.filters, idx)
        if self._read_back is not None and logits.is_cuda:  # the last tokens have left `out`
            torch.cuda.current_stream(logits.device).wait_event(self._read_back)
        tokens = sample_tokens(x, inv_temp, thr, sent.keys, out)
        parts, kmax = [tokens], 0
        if raw_lp is not None:
            kmax = min(max(step.top_ns), vocab)
            parts += logprob_tensors(raw_lp, tokens[idx["lp_rows"]], kmax)
        # the tokens alone go back as they are; with logprobs, all as float64 in one copy
        packed = tokens if len(parts) == 1 else torch.cat([t.flatten().double() for t in parts])
        pending = PendingSample(packed, n, step.ints["lp_rows"], step.top_ns, kmax)
        pending.tokens_device = tokens  # for the next step's inputs (overlapped stepping)
        self._read_back = pending._event
        return pending

    # ---- penalties and bans ------------------------------------------------------------

    def adjusted_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """A float32 copy of (N, V) logits with penalties applied and min_tokens bans set:
        what greedy rows take the argmax of and sampled rows divide by their temperature."""
        step = self._plan(seqs, logits.shape[1], logits.device, sampling=False)
        return self._adjust(logits, step, step.send(logits.device), copy=True)

    def _plan(
        self, seqs: list[Sequence], vocab: int, device: torch.device, sampling: bool
    ) -> _Step:
        step = _Step(len(seqs))
        lp_rows: list[int] = []
        pen: list[int] = []
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        sampled: list[int] = []
        for i, s in enumerate(seqs):
            p = s.params
            if s.sample_seed is None:
                s.sample_seed = self._rng.getrandbits(64)
            k, tp, mp = row_params(vocab, p.top_k, p.top_p, p.min_p)
            inv = 0.0 if p.greedy else 1.0 / p.temperature
            lo, hi = split_seed(s.sample_seed)
            n_out = len(s.output_token_ids)
            rep, freq, pres = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
            step.rows += [inv, k, tp, mp, rep, freq, pres]
            step.keys += [lo, hi, n_out]
            top_k.append(p.top_k)
            top_p.append(p.top_p)
            min_p.append(p.min_p)
            if not p.greedy:
                sampled.append(i)
            if p.logprobs is not None:
                lp_rows.append(i)
                step.top_ns.append(p.logprobs)
            if p.has_penalties:
                pen.append(i)
            if n_out < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos))
                for t in sorted(banned):
                    if 0 <= t < vocab:
                        ban_rows.append(i)
                        ban_cols.append(t)
        step.ints = {"lp_rows": lp_rows, "pen_rows": pen, "ban_rows": ban_rows}
        step.ints["ban_cols"] = ban_cols
        if sampling:
            step.filters = FilterPlan.build(vocab, top_k, top_p, min_p, sampled)
            for name in ("minp", "topk", "sort"):
                step.ints[name] = getattr(step.filters, name)
        if pen:
            step.penalties = self._penalties.plan([seqs[i] for i in pen], vocab, device)
            for name in _PEN_FIELDS:
                step.ints[name] = getattr(step.penalties, name)
        return step

    def _adjust(
        self,
        logits: torch.Tensor,
        step: _Step,
        sent: _Sent,
        copy: bool = False,
    ) -> torch.Tensor:
        """Float32 logits with penalties and bans; a copy when it changes them (or asked)."""
        pen, bans, idx = step.penalties is not None, bool(step.ints["ban_rows"]), sent.idx
        x = logits.to(torch.float32, copy=copy or pen or bans)
        if pen:
            self._penalties.update(idx)
            chunk = row_chunk(len(step.ints["pen_rows"]))
            parts = zip(idx["pen_rows"].split(chunk), idx["slots"].split(chunk), strict=True)
            for rows, slots in parts:
                counts, seen = self._penalties.rows(slots)
                sub = x[rows]
                rep, freq, pres = (sent.cols[c][rows, None] for c in (4, 5, 6))
                # in place, one (R, V) temporary at a time (the memory reserve), with the
                # arithmetic of where(seen, where(sub > 0, sub / rep, sub * rep), sub)
                pos = sub > 0
                torch.where(seen & pos, sub / rep, sub, out=sub)
                torch.where(seen & ~pos, sub * rep, sub, out=sub)
                del pos, seen
                sub -= freq * counts
                # pres * (counts > 0) would cast the mask to a float copy first (the same
                # values; only a -0.0 logit with a negative pres keeps its sign)
                torch.where(counts > 0, sub - pres, sub, out=sub)
                x[rows] = sub
        if bans:
            # index_put_ with a device value: assigning a Python float syncs the host
            ninf = torch.full((), _NEG_INF, device=x.device)
            x.index_put_((idx["ban_rows"], idx["ban_cols"]), ninf)
        return x
