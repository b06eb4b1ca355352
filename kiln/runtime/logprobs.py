"""Log-probabilities returned with sampled and prompt tokens (the vLLM shape).

They are always those of the model's *raw* distribution: ``log_softmax`` of the logits as
the model produced them, before temperature, penalties, min_tokens bans and top-k / top-p /
min-p filtering (vLLM's default ``"raw_logprobs"`` mode). So a greedy and a sampled request
see the same numbers for the same context, and they describe the model, not the sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.kernels.attention import to_device
from kiln.runtime import side_copies
from kiln.runtime.filters import row_chunk

# prompt logprobs are computed this many rows at a time at least (or max_batch_size rows,
# if more): the logits and their log_softmax of a whole prefill chunk (max_num_tokens rows)
# would take 8 bytes a vocabulary entry a token, 8 GiB for 16,384 tokens of a 128k vocab
PROMPT_LOGPROB_ROWS = 256


def prompt_logprob_rows(max_batch_size: int) -> int:
    """How many prompt positions get their logits (and logprobs) at once: within the
    sampler's (max_batch_size, vocab) reserve that ``measure_activation_peak`` holds back."""
    return max(max_batch_size, PROMPT_LOGPROB_ROWS)


@dataclass(slots=True)  # thousands a step at 20 logprobs a row: no __dict__ each
class Logprob:
    """One token's log-probability and 1-based rank in the distribution (1 = most likely).
    ``decoded_token`` is filled by whoever holds a tokenizer; the sampler leaves it None."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def logprob_tensors(
    logprobs: torch.Tensor, token_ids: torch.Tensor, kmax: int
) -> list[torch.Tensor]:
    """The device half of the logprob dicts (``build_logprob_dicts`` is the host half): for
    (R, V) logprobs and (R,) int64 chosen tokens, ``[chosen logprob (R,), rank (R,),
    top-kmax logprobs (R, kmax), their ids (R, kmax)]`` (the last two only when kmax > 0).
    No host synchronization."""
    chosen = logprobs.gather(1, token_ids[:, None])  # (R, 1)
    # a sum of bools makes an int64 copy (8 bytes an entry): a chunk of rows at a time
    chunk = row_chunk(logprobs.shape[0])
    pairs = zip(logprobs.split(chunk), chosen.split(chunk), strict=True)
    out = [chosen[:, 0], torch.cat([(lp > c).sum(-1) for lp, c in pairs]) + 1]
    if kmax > 0:
        out.extend(logprobs.topk(kmax, dim=-1))
    return out


def build_logprob_dicts(
    token_ids: list[int], top_ns: list[int], kmax: int, flat: list[float]
) -> list[dict[int, Logprob]]:
    """For each of R = len(token_ids) rows, a dict holding ``token_ids[r]`` and the row's
    ``top_ns[r]`` most likely tokens, from ``flat``: ``logprob_tensors``' outputs for the
    rows, flattened and concatenated in order (one transfer to the host, whatever R).

    The chosen token comes first, ranked ``1 + (number of tokens with a strictly higher
    logprob)``; the top-n follow with ranks 1..n by position (a tie keeps topk's order). A
    chosen token that is also in the top-n keeps its own rank."""
    rows = len(token_ids)
    values, ids = 2 * rows, 2 * rows + rows * kmax  # where the top-k values and ids start
    out: list[dict[int, Logprob]] = []
    for r in range(rows):
        d = {token_ids[r]: Logprob(flat[r], int(flat[rows + r]))}
        a, n = r * kmax, min(top_ns[r], kmax)
        tops = zip(flat[ids + a : ids + a + n], flat[values + a : values + a + n], strict=True)
        for rank, (tok, v) in enumerate(tops, 1):
            if (t := int(tok)) not in d:
                d[t] = Logprob(v, rank)
        out.append(d)
    return out


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], top_n: int
) -> list[dict[int, Logprob]]:
    """Logprobs of a prompt: row m of ``logits`` (M, V) is the model's prediction after prompt
    position m, and ``next_token_ids[m]`` the prompt token that actually follows it. Returns
    one dict per row with that token's logprob and rank plus the ``top_n`` most likely."""
    out: list[dict[int, Logprob]] = []
    PendingPromptLogprobs([prompt_logprob_chunk(logits, next_token_ids, top_n, out)]).resolve()
    return out


@dataclass
class PromptLogprobChunk:
    """Prompt logprobs of consecutive positions of one request, still on the device:
    ``logprob_tensors``' outputs, flattened and concatenated (``flat``), for ``token_ids``
    (the prompt tokens that follow those positions). ``PendingPromptLogprobs`` appends
    them to ``owner`` (the request's ``prompt_logprobs`` list) once the step is read back."""

    owner: list[Any]
    token_ids: list[int]
    top_n: int
    kmax: int
    flat: torch.Tensor


def prompt_logprob_chunk(
    logits: torch.Tensor, next_token_ids: list[int], top_n: int, owner: list[Any]
) -> PromptLogprobChunk:
    """``prompt_logprobs``' device side, without waiting for the device: row m of
    ``logits`` (M, V) predicts ``next_token_ids[m]``."""
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} logit rows but {len(next_token_ids)} next tokens")
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = to_device(next_token_ids, torch.int64, lp.device)
    kmax = min(top_n, lp.shape[1])
    flat = torch.cat([t.flatten().double() for t in logprob_tensors(lp, ids, kmax)])
    return PromptLogprobChunk(owner, list(next_token_ids), top_n, kmax, flat)


class PendingPromptLogprobs:
    """A step's prompt-logprob chunks on their way to the host: one pinned copy, started
    when the step is launched (``side_copies.read_back``, so the next step's work does not
    queue behind it); ``resolve()`` waits for it and appends each chunk's dicts (those of
    ``prompt_logprobs``) to its owner, in order."""

    def __init__(self, chunks: list[PromptLogprobChunk]) -> None:
        self._chunks = [(c.owner, c.token_ids, c.top_n, c.kmax, c.flat.numel()) for c in chunks]
        self._host, self._event = side_copies.start_host_copy(torch.cat([c.flat for c in chunks]))

    def resolve(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        flat = self._host.tolist()
        at = 0
        for owner, token_ids, top_n, kmax, n in self._chunks:
            top_ns = [top_n] * len(token_ids)
            owner.extend(build_logprob_dicts(token_ids, top_ns, kmax, flat[at : at + n]))
            at += n
        self._chunks = []  # resolved once
