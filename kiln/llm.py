"""``kiln.LLM``: the offline Python API."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kiln.build.cache import cache_root, cached_engine
from kiln.build.engine_dir import MANIFEST
from kiln.build.loader import LoadedEngine, load_engine
from kiln.checkpoint import default_model_path
from kiln.config import BuildConfig, KvCacheConfig
from kiln.errors import ConfigError, bad_value
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.runtime.kv_cache import KVCache, kv_bytes_per_token
from kiln.runtime.loop import BatchLoop
from kiln.runtime.runner import ModelRunner
from kiln.runtime.sampler import Sampler
from kiln.runtime.sequence import Sequence
from kiln.sampling_params import SamplingParams
from kiln.tokenizer import load_tokenizer

Prompt = str | list[int]


class LLM:
    """An engine loaded for generation.

    ``model`` is an engine directory, a Hugging Face directory, a ``.gguf`` file or a
    ``dummy:<preset>``; None means the embedded SmolLM2-135M-Instruct. A checkpoint is built
    into the cache (``$KILN_CACHE_DIR`` or ``~/.cache/kiln``) on first use with the build
    options given here; an engine directory already fixes them.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        max_num_tokens: int = 8192,
        kv_cache_config: KvCacheConfig | None = None,
        seed: int = 0,
        progress: bool = True,
    ) -> None:
        source = str(model) if model is not None else str(default_model_path())
        path = Path(source).expanduser()
        if not source.startswith("dummy:") and (path / MANIFEST).is_file():
            engine_dir = path
        else:
            build = BuildConfig(
                dtype=dtype,
                device=device,
                max_batch_size=max_batch_size,
                max_seq_len=max_seq_len,
                max_num_tokens=max_num_tokens,
            )
            engine_dir = cached_engine(source, build, seed=seed, progress=progress)
        self.engine: LoadedEngine = load_engine(
            engine_dir, device, stamp_dir=cache_root() / "verified"
        )
        self.config = self.engine.config
        self.tokenizer = load_tokenizer(engine_dir, self.engine.manifest)
        limits = self.engine.limits
        self.max_seq_len: int = limits["max_seq_len"]
        self.kv_cache_config = kv_cache_config or KvCacheConfig()
        self.kv = self._allocate_kv_cache(self.kv_cache_config)
        gen = torch.Generator(device=self.engine.device)
        gen.manual_seed(seed)
        self.sampler = Sampler(self.config.eos_token_ids, gen)
        self.runner = ModelRunner(self.engine.model, self.kv, self.engine.device)
        self.loop = BatchLoop(
            self.runner,
            self.kv,
            self.sampler,
            limits["max_batch_size"],
            limits["max_num_tokens"],
            self.config.eos_token_ids,
        )
        self._ids = itertools.count()

    def _allocate_kv_cache(self, kc: KvCacheConfig) -> KVCache:
        per_token = kv_bytes_per_token(self.config, self.engine.dtype)
        if kc.max_tokens is not None:
            tokens = kc.max_tokens
        elif self.engine.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.engine.device)
            # Leave room for activations of a full step: a rough bound until the runtime
            # measures its peak (in-flight batching issue).
            limits = self.engine.limits
            reserve = limits["max_num_tokens"] * (
                self.config.hidden_size * 48 + self.config.intermediate_size * 8
            )
            reserve += limits["max_batch_size"] * self.config.vocab_size * 8
            tokens = max(0, int((free - reserve) * kc.free_gpu_memory_fraction)) // per_token
        else:
            tokens = kc.cpu_bytes // per_token
        tokens = min(tokens, self.engine.limits["max_batch_size"] * self.max_seq_len)
        num_blocks = tokens // kc.tokens_per_block
        if num_blocks < 1:
            raise ConfigError(
                f"the KV cache would hold {tokens} tokens, less than one block of "
                f"{kc.tokens_per_block}; raise kv_cache_config.max_tokens or free memory."
            )
        return KVCache(
            self.config, num_blocks, kc.tokens_per_block, self.engine.dtype, self.engine.device
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.tokens_per_block

    # ---- requests ---------------------------------------------------------------------

    def _make_sequence(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, Sequence]:
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            vocab = self.config.vocab_size
            bad = [
                t
                for t in ids
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
            ]
            if bad:
                raise bad_value(
                    "prompt_token_ids", bad[:5], f"token ids must be integers in [0, {vocab})"
                )
        if not ids:
            raise bad_value(
                "prompt", prompt, "an empty prompt cannot be continued; pass at least one token"
            )
        if len(ids) >= self.max_seq_len:
            raise bad_value(
                "prompt",
                f"<{len(ids)} tokens>",
                f"the engine's max_seq_len is {self.max_seq_len}, so a prompt may have at most "
                f"{self.max_seq_len - 1} tokens",
            )
        total = min(len(ids) + params.max_tokens, self.max_seq_len)
        if self.kv.blocks_for(total) > self.kv.num_blocks:
            raise bad_value(
                "max_tokens",
                params.max_tokens,
                f"prompt ({len(ids)} tokens) plus max_tokens needs {total} tokens of KV cache and "
                f"the cache holds {self.kv_capacity_tokens}; lower max_tokens or raise "
                "kv_cache_config.max_tokens",
            )
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.engine.device)
            gen.manual_seed(params.seed)
        seq = Sequence(str(next(self._ids)), ids, params, total, generator=gen)
        return text, seq

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs keep the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise bad_value(
                "sampling_params", f"<{len(params)} items>", f"one per prompt ({len(prompts)})"
            )
        made = [self._make_sequence(p, sp) for p, sp in zip(prompts, params, strict=True)]
        bar = tqdm(
            total=len(made), desc="generating", unit="req", disable=not use_tqdm or len(made) < 2
        )
        self.loop.run([s for _, s in made], on_finish=lambda _: bar.update())
        bar.close()
        return [self._output(text, seq) for text, seq in made]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        prompts: list[Prompt] = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

    def _output(self, text: str | None, seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens),
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(seq.request_id, text, seq.prompt_token_ids, [completion])
