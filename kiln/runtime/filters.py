"""min-p, top-k and top-p as one keep-threshold per row, computed on the logits' device with
no host synchronization: a token survives when its logit is ``>= threshold``.

Semantics (in the temperature-scaled distribution ``softmax(x / T)``): min-p drops tokens
whose probability is below ``min_p`` times the top token's (a ratio, so it commutes with
top-k); top-k keeps the k highest (ties with the k-th kept); top-p then drops a token when
the mass of the tokens ranked before it, renormalized over what min-p and top-k left,
already reaches ``top_p`` (vLLM's order). The top token always survives. Each filter drops
a tail of the sorted row, so what is left is every token at or above one value: a token
tied with the last one kept is kept too.

Which rows need what is known on the host from their parameters, so the work is planned
there (``FilterPlan``) and the device only gets index tensors: rows with min-p alone need
their max only; rows with a top-k need their K largest (K = the largest k among them; the
renormalized top-p mass then leaves out tokens tied with the k-th beyond those K); rows with
top-p and no top-k sort their whole row."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.kernels.top_p import top_p_thresholds_triton, use_top_p_kernel

_NEG_INF = float("-inf")
# the sampler's row-wise (R, V) work (top-k / top-p thresholds, penalties) goes in at most
# this many chunks of at least _CHUNK_ROWS rows: few launches, and temporaries of an eighth
# of a large batch
_CHUNKS, _CHUNK_ROWS = 8, 64


def row_chunk(rows: int) -> int:
    """Rows a chunk of ``rows`` rows' (R, V) work takes at once."""
    return max(_CHUNK_ROWS, -(-rows // _CHUNKS))


@dataclass
class FilterPlan:
    """Row groups of one batch (row indices into it): ``minp`` (min-p only), ``topk``
    (top-k, maybe with top-p and min-p; ``k`` = the largest k among them) and ``sort``
    (top-p without top-k). Rows in none of them keep every token."""

    minp: list[int] = field(default_factory=list)
    topk: list[int] = field(default_factory=list)
    sort: list[int] = field(default_factory=list)
    k: int = 0

    @classmethod
    def build(
        cls, vocab: int, top_k: list[int], top_p: list[float], min_p: list[float], rows: list[int]
    ) -> FilterPlan:
        """Plan for the given rows (the sampled ones) of parameter lists indexed by row."""
        plan = cls()
        for i in rows:
            if 0 < top_k[i] < vocab:
                plan.topk.append(i)
                plan.k = max(plan.k, top_k[i])
            elif top_p[i] < 1.0:
                plan.sort.append(i)
            elif min_p[i] > 0.0:
                plan.minp.append(i)
        return plan

    @property
    def empty(self) -> bool:
        return not (self.minp or self.topk or self.sort)


def row_params(vocab: int, top_k: int, top_p: float, min_p: float) -> tuple[int, float, float]:
    """One row's (k, p, m) as ``keep_thresholds`` wants them: k = vocab when top-k is off,
    p = inf when top-p is off."""
    return (top_k if 0 < top_k < vocab else vocab, top_p if top_p < 1.0 else float("inf"), min_p)


def keep_thresholds(
    x: torch.Tensor,  # (N, V) float32
    inv_temp: torch.Tensor,  # (N,) float32, 1 / temperature
    top_k: torch.Tensor,  # (N,) int64, vocab = off
    top_p: torch.Tensor,  # (N,) float32, inf = off
    min_p: torch.Tensor,  # (N,) float32, 0 = off
    plan: FilterPlan,
    groups: dict[str, torch.Tensor],  # "minp" / "topk" / "sort" -> int64 row indices
) -> torch.Tensor:
    """(N,) float32 thresholds on x (-inf for rows outside the plan's groups)."""
    thr = torch.full((x.shape[0],), _NEG_INF, device=x.device, dtype=x.dtype)
    if plan.minp:
        idx = groups["minp"]
        thr[idx] = x[idx].amax(-1) + torch.log(min_p[idx]) / inv_temp[idx]
    for name, k in (("topk", plan.k), ("sort", x.shape[1])):
        rows = len(getattr(plan, name))
        if name == "sort" and use_top_p_kernel(x, rows):  # no sort, no (R, V) temporary
            idx = groups["sort"]
            thr[idx] = top_p_thresholds_triton(x, idx, inv_temp, top_p, min_p)
            continue
        # a chunk of rows at a time, so that the sort's and the masks' (R, V) temporaries
        # (sorted values, int64 indices, probabilities, sums: about six float32 arrays'
        # worth) stay within the sampler's memory reserve
        for part in groups[name].split(row_chunk(rows)) if rows else ():
            thr[part] = _tail_thresholds(x, part, k, inv_temp, top_k, top_p, min_p)
    return thr


def _tail_thresholds(
    x: torch.Tensor,
    idx: torch.Tensor,
    k: int,
    inv_temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """(R,) thresholds of the rows ``idx`` of x from their k largest logits (k = V: the
    whole row, sorted): min-p, then top-k, then top-p over what is left."""
    sub = x[idx]
    vals = sub.sort(-1, descending=True)[0] if k == x.shape[1] else sub.topk(k, -1)[0]
    del sub  # each temporary goes as soon as it is done with; the arithmetic is unchanged
    it = inv_temp[idx, None]
    drop = vals < vals[:, :1] + torch.log(min_p[idx, None]) / it
    kth = (top_k[idx, None].clamp(1, k) - 1).to(torch.int64)
    drop |= vals < vals.gather(1, kth)
    # dropped tokens sit at the tail of the sorted row, so it stays sorted
    scaled = vals * it
    probs = scaled.masked_fill_(drop, _NEG_INF).softmax(-1)
    del scaled
    before = probs.cumsum(-1)
    before -= probs  # the mass ranked before each token
    del probs
    drop |= before >= top_p[idx, None]
    del before
    drop[:, 0] = False
    kept = (~drop).sum(-1, keepdim=True)  # (an int64 copy of the mask: 8 bytes an entry)
    return vals.gather(1, kept - 1)[:, 0]


def filter_batch(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Row-wise min-p, top-k and top-p masking of (N, V) logits (temperature already
    applied): a new tensor with the dropped tokens at -inf."""
    n, vocab = logits.shape
    plan = FilterPlan.build(vocab, top_k, top_p, min_p, list(range(n)))
    if plan.empty:
        return logits.clone()
    dev = logits.device
    cols = [row_params(vocab, *a) for a in zip(top_k, top_p, min_p, strict=True)]
    k, p, m = (torch.tensor(c, device=dev) for c in zip(*cols, strict=True))
    groups = {
        name: torch.tensor(getattr(plan, name), device=dev, dtype=torch.int64)
        for name in ("minp", "topk", "sort")
    }
    x = logits.float()
    ones = torch.ones(n, device=dev)
    thr = keep_thresholds(x, ones, k.long(), p.float(), m.float(), plan, groups)
    return logits.masked_fill(x < thr[:, None], _NEG_INF)


def filter_logits(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Mask (set to -inf) tokens of one row (vocab,) outside the top-k, below min-p and
    outside the top-p nucleus; at least the most likely token always survives."""
    return filter_batch(logits[None], [top_k], [top_p], [min_p])[0]
