"""Quality of a model on a text: perplexity, and how far a second model (a quantized build,
say) strays from a reference: perplexity increase, top-1 agreement and KL divergence.

Every forward pass goes through kiln's own model and paged attention, on the device the
engine lives on: one sequence per window, prefilled in one step into a scratch KV cache, so
the figures reflect kiln's kernels. Each window's attention reads its keys and values back
from the cache (``AttentionMetadata.fresh_prefill`` off), as decode steps do. Log-softmax
and every statistic run in float32; sums are accumulated in float64 on the host. Memory
stays bounded: windows of at most ``window`` tokens (512 by default), at most
``max_tokens`` tokens of text (4096 by default), and only one window's logits per model
alive at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kiln.build.loader import LoadedEngine
from kiln.errors import ConfigError, bad_value
from kiln.kernels.attention import AttentionMetadata
from kiln.runtime.kv_cache import KVCache
from kiln.tokenizer import load_tokenizer

DEFAULT_WINDOW = 512
BOOTSTRAP = 2000  # window resamples behind the perplexity increase's interval
DEFAULT_MAX_TOKENS = 4096
_TOKENS_PER_BLOCK = 16


@dataclass(frozen=True)
class Window:
    """One forward pass: ``ids`` (a BOS first when the model has one); the tokens at
    positions ``score_from..len(ids)-1`` are scored, each predicted from the logits of the
    position before it."""

    ids: list[int]
    score_from: int

    @property
    def num_scored(self) -> int:
        return len(self.ids) - self.score_from


@dataclass
class PerplexityReport:
    num_tokens: int
    num_windows: int
    window: int
    mean_nll: float
    ppl: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class QualityReport:
    num_tokens: int
    num_windows: int
    window: int
    ppl_ref: float
    ppl_test: float
    ppl_increase_pct: float
    """100 * (ppl_test / ppl_ref - 1)."""
    ppl_increase_ci95: tuple[float, float]
    """The 2.5th and 97.5th percentiles of ``ppl_increase_pct`` over ``BOOTSTRAP`` resamples
    of the windows (with replacement, fixed seed): how much the figure owes to the choice of
    text. (It does not cover differences between builds.) One window: the figure twice."""
    top1_agreement: float
    """Share of scored positions where both models' argmax tokens agree."""
    mean_kl: float
    """Mean over scored positions of KL(ref || test) of the next-token distributions, nats."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ModelLike = Any  # kiln.LLM or a LoadedEngine


def _engine(model_like: ModelLike) -> LoadedEngine:
    engine = getattr(model_like, "engine", model_like)
    if not isinstance(engine, LoadedEngine):
        raise TypeError(f"expected a kiln.LLM or a LoadedEngine, got {type(model_like).__name__}")
    return engine


def _tokenizer(model_like: ModelLike) -> Any:
    tok = getattr(model_like, "tokenizer", None)
    if tok is None:
        engine = _engine(model_like)
        tok = load_tokenizer(engine.root, engine.manifest)
    return tok


def _encode(model_like: ModelLike, text: str) -> list[int]:
    return _tokenizer(model_like).encode(text, add_special_tokens=False)


def _bos(model_like: ModelLike, add_bos: bool | None) -> int | None:
    """The BOS id each window starts with: with ``add_bos=None``, the model's BOS when its
    tokenizer puts one before a text (Llama 2/3 do; SmolLM2 does not)."""
    bos = _engine(model_like).config.bos_token_id
    if bos is None or add_bos is False:
        return None
    if add_bos:
        return bos
    tok = _tokenizer(model_like)
    with_special = tok.encode("The", add_special_tokens=True)
    plain = tok.encode("The", add_special_tokens=False)
    return bos if with_special[:1] == [bos] and plain[:1] != [bos] else None


def token_windows(
    token_ids: Sequence[int],
    window: int = DEFAULT_WINDOW,
    stride: int | None = None,
    bos_token_id: int | None = None,
) -> list[Window]:
    """Cover ``token_ids`` with windows of at most ``window`` ids (the BOS included when
    ``bos_token_id`` is given) whose starts are ``stride`` text tokens apart (default: no
    overlap). Every text token is scored exactly once, except the very first when there is
    no BOS, and except the first of each window when windows do not overlap and there is no
    BOS (it has no context). With a stride below the window, a window scores only the tokens
    the previous one did not, each with at least ``window - stride`` tokens of context."""
    bos = 1 if bos_token_id is not None else 0
    span = window - bos  # text tokens per window
    if window < 2:
        raise bad_value("window", window, "at least 2 tokens are needed")
    stride = span if stride is None else stride
    if not 1 <= stride <= span:
        raise bad_value("stride", stride, f"it must be between 1 and {span} (the window)")
    ids = list(token_ids)
    out: list[Window] = []
    start, scored_to = 0, 0  # text tokens before scored_to are scored already
    while start < len(ids):
        end = min(start + span, len(ids))
        prefix = [bos_token_id] if bos_token_id is not None else []
        score_from = max(1, scored_to - start + bos)
        w = Window(prefix + ids[start:end], score_from)
        if w.num_scored > 0:
            out.append(w)
        scored_to = end
        if end == len(ids):
            break
        start += stride
    return out


class _Scratch:
    """A KV cache for one sequence of up to ``capacity`` tokens, reused across windows."""

    def __init__(self, engine: LoadedEngine, capacity: int) -> None:
        blocks = -(-capacity // _TOKENS_PER_BLOCK)
        quant = engine.manifest.get("quant") or {}
        fp8 = quant.get("kv_cache_dtype") == "fp8"  # the engine's own fp8 cache and scales
        self.kv = KVCache(
            engine.config,
            blocks,
            _TOKENS_PER_BLOCK,
            engine.dtype,
            engine.device,
            kv_dtype="fp8" if fp8 else None,
            scales=quant.get("kv_scales") if fp8 else None,
        )
        self.table = list(range(blocks))


@torch.inference_mode()
def window_logits(
    model_like: ModelLike, ids: Sequence[int], first: int = 0, scratch: _Scratch | None = None
) -> torch.Tensor:
    """(len(ids) - first, vocab) float32 logits of positions ``first..`` of one sequence,
    prefilled in one step through kiln's paged attention on the engine's device."""
    engine = _engine(model_like)
    dev, n = engine.device, len(ids)
    scratch = scratch or _Scratch(engine, n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([scratch.table], dtype=torch.int32, device=dev),
        slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        # every attention read through the cache, as decode steps read it: an fp8 cache's
        # cost measured whole (serving's whole prompts attend over their own K/V as
        # computed, at no more loss than this)
        fresh_prefill=False,
    )
    ids_t = torch.tensor(list(ids), dtype=torch.int64, device=dev)
    pos = torch.arange(n, device=dev)
    hidden = engine.model(ids_t, pos, scratch.kv.layers, meta, kv_scales=scratch.kv.scales)
    return engine.model.compute_logits(hidden[first:]).float()


def perplexity_and_logits(
    model_like: ModelLike, windows: Sequence[Window]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For each window, yield (nll, logprobs): the float32 negative log-likelihood of each
    scored token, shape (k,), and the float32 log-softmax rows that predicted them, shape
    (k, vocab), both on the engine's device. One window at a time, so memory stays bounded."""
    engine = _engine(model_like)
    if not windows:
        return
    scratch = _Scratch(engine, max(len(w.ids) for w in windows))
    for w in windows:
        vocab_ids = [i for i in w.ids if not 0 <= i < engine.config.vocab_size]
        if vocab_ids:
            raise bad_value(
                "token id",
                vocab_ids[0],
                f"ids must be below the vocabulary size {engine.config.vocab_size}",
            )
        logits = window_logits(engine, w.ids[:-1], w.score_from - 1, scratch)
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(w.ids[w.score_from :], dtype=torch.int64, device=logprobs.device)
        nll = -logprobs.gather(1, targets[:, None]).squeeze(1)
        yield nll, logprobs


def _limit_window(engine: LoadedEngine, window: int) -> int:
    lim = engine.limits
    cap = min(lim["max_seq_len"], lim["max_num_tokens"], engine.config.max_position_embeddings)
    return min(window, cap)


def check_counts(max_tokens: int, window: int, stride: int | None) -> None:
    """The scoring counts that can be refused before any model is at hand."""
    for field, value in (("max_tokens", max_tokens), ("window", window)):
        if value < 2:
            raise bad_value(field, value, "at least 2 tokens are needed")
    if stride is not None and stride < 1:
        raise bad_value("stride", stride, "at least 1 token (at most the window)")


def _prepare(
    model_like: ModelLike,
    text: str | Sequence[int],
    max_tokens: int,
    window: int,
    stride: int | None,
    add_bos: bool | None,
) -> tuple[list[Window], int]:
    check_counts(max_tokens, window, stride)
    engine = _engine(model_like)
    ids = _encode(model_like, text) if isinstance(text, str) else list(text)
    ids = ids[:max_tokens]
    window = _limit_window(engine, window)
    windows = token_windows(ids, window, stride, _bos(model_like, add_bos))
    if not windows:
        raise ConfigError(
            f"the text has {len(ids)} token(s), too few to score; give a longer text."
        )
    return windows, window


def evaluate(
    llm: ModelLike,
    text: str | Sequence[int],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    window: int = DEFAULT_WINDOW,
    stride: int | None = None,
    add_bos: bool | None = None,
) -> PerplexityReport:
    """Perplexity of one model (a ``kiln.LLM`` or ``LoadedEngine``) on ``text`` (a string,
    tokenized with the model's tokenizer without special tokens, or token ids). Each window
    starts with the model's BOS when ``add_bos`` is True, or when it is None and the
    tokenizer adds one (the reference's tokenizer, for ``compare``)."""
    windows, window = _prepare(llm, text, max_tokens, window, stride, add_bos)
    total, count = 0.0, 0
    for nll, _ in perplexity_and_logits(llm, windows):
        total += nll.double().sum().item()
        count += nll.numel()
    mean = total / count
    return PerplexityReport(count, len(windows), window, mean, math.exp(mean))


def compare(
    ref_llm: ModelLike,
    test_llm: ModelLike,
    text: str | Sequence[int],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    window: int = DEFAULT_WINDOW,
    stride: int | None = None,
    add_bos: bool | None = None,
) -> QualityReport:
    """How ``test_llm`` differs from ``ref_llm`` on ``text``: both models score the same
    windows of the same tokens (tokenized once, by the reference's tokenizer). The models
    must share the vocabulary; with text, their tokenizers must agree on it."""
    ref, test = _engine(ref_llm), _engine(test_llm)
    if ref.config.vocab_size != test.config.vocab_size:
        raise ConfigError(
            f"the models do not share a vocabulary (reference {ref.config.vocab_size} tokens, "
            f"test {test.config.vocab_size}); compare builds of the same checkpoint."
        )
    if ref.config.bos_token_id != test.config.bos_token_id:
        raise ConfigError(
            f"the models' BOS tokens differ ({ref.config.bos_token_id} and "
            f"{test.config.bos_token_id}); compare builds of the same checkpoint."
        )
    if isinstance(text, str):
        ids = _encode(ref_llm, text)[:max_tokens]
        if _encode(test_llm, text)[:max_tokens] != ids:
            raise ConfigError(
                "the models' tokenizers split the text differently; compare builds of the "
                "same checkpoint."
            )
        text = ids
    window = min(_limit_window(ref, window), _limit_window(test, window))
    windows, window = _prepare(ref_llm, text, max_tokens, window, stride, add_bos)
    kl = 0.0
    agree = 0
    per_window: list[tuple[float, float, int]] = []  # (NLL ref, NLL test, tokens) sums
    pairs = zip(
        perplexity_and_logits(ref_llm, windows),
        perplexity_and_logits(test_llm, windows),
        strict=True,
    )
    for (n_ref, lp_ref), (n_test, lp_test) in pairs:
        lp_test = lp_test.to(lp_ref.device)
        per_window.append((n_ref.double().sum().item(), n_test.double().sum().item(),
                           n_ref.numel()))  # fmt: skip
        agree += int((lp_ref.argmax(-1) == lp_test.argmax(-1)).sum().item())
        # KL(ref || test) = sum_v p_ref (log p_ref - log p_test), per position
        kl_pos = F.kl_div(lp_test, lp_ref, reduction="none", log_target=True).sum(-1)
        kl += kl_pos.double().sum().item()
    nll_ref, nll_test, count = (sum(col) for col in zip(*per_window, strict=True))
    ppl_ref, ppl_test = math.exp(nll_ref / count), math.exp(nll_test / count)
    return QualityReport(
        num_tokens=count,
        num_windows=len(windows),
        window=window,
        ppl_ref=ppl_ref,
        ppl_test=ppl_test,
        ppl_increase_pct=100.0 * (ppl_test / ppl_ref - 1.0),
        ppl_increase_ci95=_bootstrap_ci(per_window),
        top1_agreement=agree / count,
        mean_kl=max(0.0, kl / count),
    )


def _bootstrap_ci(per_window: list[tuple[float, float, int]]) -> tuple[float, float]:
    """95 % percentile interval of the perplexity increase (%) over resamples of windows."""
    t = torch.tensor(per_window, dtype=torch.float64)  # (W, 3)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(per_window), (BOOTSTRAP, len(per_window)), generator=gen)
    sums = t[idx].sum(1)  # (B, 3)
    inc = 100.0 * torch.expm1((sums[:, 1] - sums[:, 0]) / sums[:, 2])
    lo, hi = torch.quantile(inc, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return (lo, hi)
