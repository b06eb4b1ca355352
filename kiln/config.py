"""Frozen configuration objects, validated once in ``__post_init__`` and passed whole.

``ModelConfig`` (``kiln.model_config``, re-exported here) is the normalized description of a
Llama-family model, whatever the source (Hugging Face ``config.json``, GGUF metadata, a dummy
preset). ``BuildConfig``, ``QuantConfig`` and ``Mapping`` describe what an engine was built
for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import bad_value
from kiln.model_config import (  # noqa: F401 - re-exported
    DTYPES,
    ROPE_TYPES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    unsupported_architecture,
)

QUANT_ALGOS = ("fp8", "int8-wo", "int4-awq", "w8a8-sq")
KV_CACHE_DTYPES = ("fp8", *DTYPES)
ACTIVATION_SCHEMES = ("dynamic", "static", "outliers", "smooth", "block")
FP8_BLOCK = 128  # fp8 "block": weight tiles of 128 x 128, activations per token and 128 channels
DEFAULT_ACT_OUTLIERS = 64  # fp8 "outliers" activations: input channels split in two e4m3 parts
# fp8 builds without --activation-scheme: "outliers" halved SmolLM2's loss (KL) for 1.5-4 %
# of H200 throughput (docs/quantization.md); other modes are "dynamic" (per token)
DEFAULT_FP8_SCHEME = "outliers"
ACT_SCALE_SEARCHES = (0, 2, 4, 8, 16)  # fp8 per-token scales: candidates (kiln.kernels.quant_act)
WEIGHT_ROUNDINGS = ("gptq", "nearest")
KV_ROTATIONS = ("hadamard", "none")
GPTQ_ALGOS = ("fp8", "int4-awq")  # modes whose weights a build may round with GPTQ
# modes whose projections --auto-exclude may restore one at a time (not int4-awq, whose
# AWQ factors are folded into neighbouring layers)
AUTO_EXCLUDE_ALGOS = ("fp8", "int8-wo", "w8a8-sq")
INT4_DEFAULT_GROUP_SIZE = 128
# calibration tokens a build runs the model on; SmolLM2 int4-awq g64 (16,352 held-out tokens,
# GPTQ without clipping) measured +10.28 % / KL 0.108 with 2,048, +7.80 % / 0.076 with 8,192
# and +6.05 % / 0.069 with 16,384 (docs/quantization.md)
DEFAULT_CALIB_TOKENS = 16384
MAX_CALIB_TOKENS = 1 << 20


DEFAULT_SQ_ALPHA = 0.5
"""SmoothQuant's migration strength when none is given."""


def uses_sq_alpha(algo: str | None, activation_scheme: str | None) -> bool:
    """Whether a mode migrates activation range into the weights (w8a8-sq, fp8 "smooth")."""
    return algo == "w8a8-sq" or (algo == "fp8" and activation_scheme == "smooth")


@dataclass(frozen=True)
class QuantConfig:
    """Weight (and activation) quantization of the decoder layers' linear projections.

    ``algo``: None (unquantized), "fp8" (e4m3 weights per output channel, activations per
    token or per tensor), "int8-wo" (int8 weights, activations in the engine dtype),
    "int4-awq" (uint4 groups along K with zero points; AWQ scales when given, else plain
    round-to-nearest) or "w8a8-sq" (int8 weights and per-token int8 activations, SmoothQuant
    factors when given). ``exclude_modules``: fnmatch patterns of module names kept
    unquantized ("layers.0.*", "*.down"); the embedding is never quantized, lm_head only
    with ``quantize_lm_head`` (fp8 with per-token activations, int8-wo, int4-awq; rounded
    as the layers are, GPTQ from the final hidden states, without AWQ factors:
    ``lm_head.proj``; a tied embedding keeps its weight).
    ``calib_text``: a text file for calibration (None: the default corpus).
    ``calib_tokens``: how many tokens of it calibration runs on (the text is repeated when
    shorter; repetition adds no information). They feed the activation statistics (AWQ,
    SmoothQuant, static fp8 scales) and GPTQ's input Hessians; the fp8 KV cache's scales
    use the first 2,048 of them (``kiln.build.builder.KV_CALIB_TOKENS``).
    ``weight_rounding``: how a build rounds fp8 / int4-awq weights, "gptq" (error-
    compensating, from calibration inputs; slower builds) or "nearest"; None: "gptq" for
    those modes. Other modes always round to nearest; dummy engines, quantized at load,
    too. ``kv_rotation``: with an fp8 KV cache, "hadamard" multiplies q and k (after rotary)
    by an orthogonal Hadamard matrix, which leaves attention scores unchanged and spreads
    k's outlier channels before the cache rounds them; "none" does not. None: "hadamard"
    where the head size allows it (a power of two >= 32). ``activation_scheme`` (fp8):
    "dynamic" (one scale per token), "static" (one calibrated scale per tensor),
    "outliers" (per token, with each projection's ``act_outliers`` input channels of
    largest calibrated amax carried in two e4m3 parts each, to about bfloat16's precision,
    in the same fp8 GEMM; a multiple of 8, None: 64; a projection splits at most an eighth
    of its inputs; the default for fp8: ``DEFAULT_FP8_SCHEME``), "smooth"
    (per token after SmoothQuant's migration of strength ``sq_alpha``: each input channel
    divided by s, the weight's column multiplied by it) or "block" (one activation scale per
    token and 128 input channels, and one weight scale per 128 x 128 tile in place of one
    per output channel: DeepSeek-V3's recipe, the layout of Hugging Face fp8 checkpoints
    with ``weight_block_size`` [128, 128]). ``sq_alpha`` is None in the modes
    that do not migrate; in those that do, None becomes 0.5. None (the scheme not given)
    becomes ``DEFAULT_FP8_SCHEME`` for fp8 and "dynamic" otherwise; ``scheme_given`` tells
    the two apart.
    ``outlier_modules``: fnmatch patterns of the projections whose outlier channels are
    split ("*.mlp.down"); empty: all of them. The others are per token as "dynamic".
    ``act_scale_search`` (fp8 with per-token activation scales: every scheme but
    "static"; with "block", per token and group): 0, or how many candidate scales
    ``amax / 448 * (1 + j / N)`` each token's (each group's) quantization tries, keeping
    the one under which its four largest magnitudes round with the least squared error
    (2, 4, 8 or 16; ``kiln.kernels.quant_act``). The GEMMs are unchanged; the quantizers
    make three more max passes over the row."""

    algo: str | None = None
    kv_cache_dtype: str | None = None  # None: same as the engine dtype
    group_size: int | None = None  # int4-awq only; default 128
    exclude_modules: tuple[str, ...] = ()
    activation_scheme: str | None = None  # fp8 only: ACTIVATION_SCHEMES; None: the default
    act_outliers: int | None = None  # fp8 "outliers" activations only
    outlier_modules: tuple[str, ...] = ()  # fp8 "outliers": the projections it applies to
    act_scale_search: int = 0  # fp8 per-token activations: candidate scales a token tries
    sq_alpha: float | None = None  # w8a8-sq, fp8 "smooth": migration strength (default 0.5)
    calib_text: str | None = None
    calib_tokens: int = DEFAULT_CALIB_TOKENS
    weight_rounding: str | None = None
    kv_rotation: str | None = None
    # quality gate: refuse to write an engine whose held-out perplexity rises more than this
    # many percent over the unquantized model's (None: measure and record only)
    max_quality_loss: float | None = None
    quality_tokens: int = 1024  # held-out tokens the build scores both models on
    # past max_quality_loss, keep up to this many of the costliest projections in full
    # precision (re-measuring after each) instead of refusing; kiln/quant/auto_exclude.py
    auto_exclude: int = 0
    quantize_lm_head: bool = False
    # set when activation_scheme was None and took the mode's default (kept by
    # dataclasses.replace and in the manifest; not compared)
    scheme_defaulted: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.algo not in (None, *QUANT_ALGOS):
            raise bad_value("quant.algo", self.algo, f"None or one of {', '.join(QUANT_ALGOS)}")
        if self.kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
            raise bad_value(
                "quant.kv_cache_dtype",
                self.kv_cache_dtype,
                f"None or one of {', '.join(KV_CACHE_DTYPES)}",
            )
        gs = self.group_size
        if self.algo == "int4-awq":
            if gs is None:
                object.__setattr__(self, "group_size", gs := INT4_DEFAULT_GROUP_SIZE)
            if not isinstance(gs, int) or isinstance(gs, bool) or gs < 2 or gs % 2:
                raise bad_value("quant.group_size", gs, "a positive even integer is required")
        elif gs is not None:
            raise bad_value("quant.group_size", gs, "only --quant int4-awq uses a group size")
        if isinstance(self.exclude_modules, str) or not all(
            isinstance(p, str) and p for p in self.exclude_modules
        ):
            raise bad_value(
                "quant.exclude_modules", self.exclude_modules, "a list of non-empty name patterns"
            )
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))
        if self.activation_scheme is None:  # stored resolved: a manifest keeps the scheme
            default = DEFAULT_FP8_SCHEME if self.algo == "fp8" else "dynamic"
            object.__setattr__(self, "activation_scheme", default)
            object.__setattr__(self, "scheme_defaulted", True)
        om = self.outlier_modules
        if isinstance(om, str) or not all(isinstance(p, str) and p for p in om):
            raise bad_value("quant.outlier_modules", om, "a list of non-empty name patterns")
        object.__setattr__(self, "outlier_modules", tuple(om))
        if om and self.activation_scheme != "outliers":
            raise bad_value(
                "quant.outlier_modules", ",".join(om), "only --activation-scheme outliers uses it"
            )
        if self.max_quality_loss is not None and not (
            isinstance(self.max_quality_loss, int | float) and self.max_quality_loss >= 0
        ):
            raise bad_value(
                "quant.max_quality_loss", self.max_quality_loss, "a percentage >= 0 or None"
            )
        qh = self.quantize_lm_head
        if not isinstance(qh, bool):
            raise bad_value("quant.quantize_lm_head", qh, "true or false")
        if qh and (
            self.algo not in ("fp8", "int8-wo", "int4-awq") or self.activation_scheme == "static"
        ):
            raise bad_value(
                "quant.quantize_lm_head",
                qh,
                "it needs --quant fp8 (per-token activations), int8-wo or int4-awq",
            )
        ae = self.auto_exclude
        if isinstance(ae, bool) or not isinstance(ae, int) or ae < 0:
            raise bad_value("quant.auto_exclude", ae, "an integer >= 0 (projections to keep)")
        if ae and self.max_quality_loss is None:
            raise bad_value(
                "quant.auto_exclude", ae, "0 unless --max-quality-loss sets the loss to meet"
            )
        if ae and self.algo not in AUTO_EXCLUDE_ALGOS:
            raise bad_value(
                "quant.auto_exclude",
                ae,
                f"0 for --quant {self.algo} (it serves {', '.join(AUTO_EXCLUDE_ALGOS)}; "
                "int4-awq folds each projection's factors into its neighbours, so use "
                "--exclude-modules)",
            )
        if not isinstance(self.quality_tokens, int) or self.quality_tokens < 16:
            raise bad_value("quant.quality_tokens", self.quality_tokens, "an integer >= 16")
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise bad_value(
                "quant.activation_scheme",
                self.activation_scheme,
                f"one of {', '.join(ACTIVATION_SCHEMES)}",
            )
        if self.activation_scheme != "dynamic" and self.algo != "fp8":
            raise bad_value(
                "quant.activation_scheme",
                self.activation_scheme,
                f"{self.activation_scheme} activation scales need --quant fp8 (or dynamic)",
            )
        ao = self.act_outliers
        if ao is not None and self.activation_scheme != "outliers":
            raise bad_value(
                "quant.act_outliers", ao, "only --activation-scheme outliers keeps channels out"
            )
        if self.activation_scheme == "outliers" and ao is None:
            object.__setattr__(self, "act_outliers", ao := DEFAULT_ACT_OUTLIERS)
        if ao is not None and (
            isinstance(ao, bool) or not isinstance(ao, int) or not 0 < ao <= 1024 or ao % 8
        ):
            # 2C more GEMM columns: fp8 GEMMs take K in multiples of 16
            raise bad_value("quant.act_outliers", ao, "a multiple of 8 from 8 to 1024")
        ss = self.act_scale_search
        if isinstance(ss, bool) or ss not in ACT_SCALE_SEARCHES:
            raise bad_value(
                "quant.act_scale_search", ss, f"one of {', '.join(map(str, ACT_SCALE_SEARCHES))}"
            )
        if ss and (self.algo != "fp8" or self.activation_scheme == "static"):
            raise bad_value(
                "quant.act_scale_search",
                ss,
                "0 unless --quant fp8 with per-token activation scales (any "
                "--activation-scheme but static; with block, each 128-channel group's)",
            )
        a = self.sq_alpha
        if a is None and uses_sq_alpha(self.algo, self.activation_scheme):
            a = DEFAULT_SQ_ALPHA
        if a is not None:
            if isinstance(a, bool) or not isinstance(a, int | float) or not 0.0 <= a <= 1.0:
                raise bad_value("quant.sq_alpha", a, "a number in [0, 1] is required")
            object.__setattr__(self, "sq_alpha", float(a))
        wr = self.weight_rounding
        if wr is not None and wr not in WEIGHT_ROUNDINGS:
            raise bad_value("quant.weight_rounding", wr, f"one of {', '.join(WEIGHT_ROUNDINGS)}")
        if wr == "gptq" and self.algo not in GPTQ_ALGOS:
            raise bad_value(
                "quant.weight_rounding",
                wr,
                f"GPTQ rounding needs --quant {' or '.join(GPTQ_ALGOS)}",
            )
        if wr is None and self.algo in GPTQ_ALGOS:
            object.__setattr__(self, "weight_rounding", "gptq")
        if self.kv_rotation not in (None, *KV_ROTATIONS):
            raise bad_value(
                "quant.kv_rotation", self.kv_rotation, f"None or one of {', '.join(KV_ROTATIONS)}"
            )
        if self.calib_text is not None and not isinstance(self.calib_text, str):
            raise bad_value("quant.calib_text", self.calib_text, "a file path or None")
        ct = self.calib_tokens
        if isinstance(ct, bool) or not isinstance(ct, int) or not 16 <= ct <= MAX_CALIB_TOKENS:
            raise bad_value(
                "quant.calib_tokens", ct, f"an integer from 16 to {MAX_CALIB_TOKENS} is required"
            )

    @property
    def scheme_given(self) -> bool:
        """Whether ``activation_scheme`` was asked for (False: the mode's default)."""
        return not self.scheme_defaulted

    @property
    def weight_block(self) -> int | None:
        """fp8 "block": the weight tile (and activation group) size; else None."""
        block = self.algo == "fp8" and self.activation_scheme == "block"
        return FP8_BLOCK if block else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class Mapping:
    """How the model is split over GPUs: tensor-parallel x pipeline-parallel ranks."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise bad_value(f"mapping.{name}", v, "a positive integer is required")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class BuildConfig:
    """Limits the engine is built for. ``max_seq_len`` counts prompt plus generated tokens;
    ``max_num_tokens`` bounds the tokens of one forward step (all sequences together)."""

    dtype: str = "auto"
    max_batch_size: int = 64
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    max_num_tokens: int = 8192
    device: str = "auto"  # "auto" | "cuda" | "cpu"
    quant: QuantConfig = field(default_factory=QuantConfig)
    mapping: Mapping = field(default_factory=Mapping)
    # reuse an earlier build's kernel tuning when every input it depends on matches
    # (kiln.build.tuning_cache); False times the kernels again
    reuse_tuning: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.reuse_tuning, bool):
            raise bad_value("reuse_tuning", self.reuse_tuning, "True or False")
        if self.dtype not in ("auto", *DTYPES):
            raise bad_value("dtype", self.dtype, f"one of auto, {', '.join(DTYPES)}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise bad_value("device", self.device, "one of auto, cuda, cpu")
        for name in ("max_batch_size", "max_num_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad_value(name, v, "a positive integer is required")
        if self.max_seq_len is not None and (
            not isinstance(self.max_seq_len, int) or self.max_seq_len < 2
        ):
            raise bad_value("max_seq_len", self.max_seq_len, "an integer >= 2 or None")

    def resolved_max_seq_len(self, model: ModelConfig) -> int:
        if self.max_seq_len is None:
            return model.max_position_embeddings
        if self.max_seq_len > model.max_position_embeddings:
            raise bad_value(
                "max_seq_len",
                self.max_seq_len,
                f"the model supports at most {model.max_position_embeddings} positions",
            )
        return self.max_seq_len


@dataclass(frozen=True)
class KvCacheConfig:
    """Paged KV cache sizing (TensorRT-LLM's name). ``max_tokens`` caps the cache in tokens;
    on a GPU the cache otherwise takes ``free_gpu_memory_fraction`` of the memory left after
    the weights; on the CPU it defaults to ``cpu_bytes`` (1 GiB). ``enable_block_reuse``
    shares computed prompt blocks between requests with the same prefix."""

    tokens_per_block: int = 32
    max_tokens: int | None = None
    free_gpu_memory_fraction: float = 0.9
    enable_block_reuse: bool = True
    cpu_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        tpb = self.tokens_per_block
        if not isinstance(tpb, int) or tpb < 1 or tpb & (tpb - 1):
            raise bad_value("kv_cache_config.tokens_per_block", tpb, "a power of two is required")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad_value(
                "kv_cache_config.max_tokens", self.max_tokens, "a positive integer or None"
            )
        f = self.free_gpu_memory_fraction
        check_memory_fraction("kv_cache_config.free_gpu_memory_fraction", f)


def check_memory_fraction(name: str, value: object) -> None:
    """A share of GPU memory, a number in (0, 1]; else a ``ConfigError`` naming ``name``
    (a field, or the flag that set it)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0.0 < value <= 1.0
    if not ok:
        raise bad_value(name, value, "a number in (0, 1]")


CAPACITY_POLICIES = ("guaranteed_no_evict", "max_utilization")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler admits requests (TensorRT-LLM's names).

    ``guaranteed_no_evict`` admits a request only when blocks for its whole generation
    (prompt + max_tokens, for all n sequences) are free after what running requests may
    still need: nothing is ever preempted. ``max_utilization`` admits as soon as the next
    prompt chunk fits and, when blocks run out, preempts the newest request, which later
    recomputes its tokens."""

    capacity_scheduler_policy: str = "guaranteed_no_evict"

    def __post_init__(self) -> None:
        if self.capacity_scheduler_policy not in CAPACITY_POLICIES:
            raise bad_value(
                "capacity_scheduler_policy",
                self.capacity_scheduler_policy,
                f"one of {', '.join(CAPACITY_POLICIES)}",
            )
