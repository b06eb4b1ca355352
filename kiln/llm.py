"""``kiln.LLM``: the offline Python API."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kiln.build.cache import BUILT_HERE, cache_root, cached_engine
from kiln.build.engine_dir import MANIFEST
from kiln.build.loader import LoadedEngine, load_engine
from kiln.checkpoint import default_model_path
from kiln.config import BuildConfig, KvCacheConfig, QuantConfig, SchedulerConfig
from kiln.errors import ConfigError, EngineDeadError, bad_value
from kiln.layers.attention import set_kv_rotation
from kiln.outputs import RequestOutput
from kiln.runtime.cuda_graphs import default_batch_sizes
from kiln.runtime.engine import EngineCore
from kiln.runtime.kernel_record import KernelRecord, compile_workers, forget_compiled
from kiln.runtime.kv_cache import KV_DTYPES, KVCache, kv_bytes_per_token, kv_storage_dtype
from kiln.runtime.memory import kv_budget_bytes, load_out_of_memory, measure_activation_peak
from kiln.runtime.stats import EngineStats
from kiln.runtime.warmup import dry_run, dry_run_wanted, warm_up_kernels
from kiln.sampling_params import SamplingParams
from kiln.tokenizer import load_tokenizer

Prompt = str | list[int]
log = logging.getLogger("kiln.llm")


class LLM:
    """An engine loaded for generation.

    ``model`` is an engine directory, a Hugging Face directory, a ``.gguf`` file or a
    ``dummy:<preset>``; None means the embedded SmolLM2-135M-Instruct. A checkpoint is built
    into the cache (``$KILN_CACHE_DIR`` or ``~/.cache/kiln``) on first use with the build
    options given here; an engine directory already fixes them.

    On a GPU, decode steps run as CUDA graphs captured at load for the batch sizes the
    engine's tuning.json lists (``cuda_graph_batch_sizes`` overrides them);
    ``enforce_eager=True`` runs every step eagerly. ``overlap_scheduling`` (default: on
    for CUDA) lets the host schedule and finish one step while the GPU computes the next.
    ``kernel_warmup`` (GPU only) compiles at load the Triton kernel variants that eager
    steps and the sampler can reach (``kiln.runtime.warmup``), so that no request waits on
    a compile; ``kernel_warmup`` then holds its seconds, steps and variants loaded.

    ``kv_cache_dtype="fp8"`` stores the KV cache as float8 e4m3 (half the bytes of 16-bit
    values per token) with per-layer k/v scales: those the engine's manifest records
    (``quant.kv_scales``), else 1.0. An engine built with ``quant.kv_cache_dtype`` uses that.
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
        scheduler_config: SchedulerConfig | None = None,
        seed: int = 0,
        progress: bool = True,
        enforce_eager: bool = False,
        cuda_graph_batch_sizes: list[int] | None = None,
        overlap_scheduling: bool | None = None,
        quant: QuantConfig | None = None,
        kv_cache_dtype: str | None = None,
        kernel_warmup: bool = True,
    ) -> None:
        if kv_cache_dtype not in KV_DTYPES:
            raise bad_value("kv_cache_dtype", kv_cache_dtype, f"one of {KV_DTYPES}")
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
                quant=quant or QuantConfig(),
            )
            engine_dir = cached_engine(source, build, seed=seed, progress=progress)
        self.engine: LoadedEngine = load_engine(
            engine_dir, device, stamp_dir=cache_root() / "verified"
        )
        # GPU, with the warm-up: the Triton variants an earlier load of this engine recorded
        # are compiled first, in threads, and the variants this load compiles are recorded
        # (kiln.runtime.kernel_record)
        cuda = self.engine.device.type == "cuda"
        record = None
        if cuda and kernel_warmup:
            record = KernelRecord.for_engine(engine_dir, self.engine.device, cache_root())
            if Path(engine_dir) in BUILT_HERE:  # its tuning compiled variants unrecorded
                forget_compiled()
        preload = record.preload(compile_workers()) if record else None
        # a first load (no record yet) may dry-run its warm-up (kiln.runtime.warmup.dry_run);
        # asked here, since the activation-peak forward below adds to the record
        dry = record is not None and not record.entries and dry_run_wanted()
        with record.recording() if record else nullcontext():
            self.config = self.engine.config
            self.tokenizer = load_tokenizer(engine_dir, self.engine.manifest)
            limits = self.engine.limits
            self.max_seq_len: int = limits["max_seq_len"]
            self.kv_cache_config = kv_cache_config or KvCacheConfig()
            self.kv_cache_dtype, self.kv_scales = self._kv_dtype(kv_cache_dtype)
            self.kv_rotation = set_kv_rotation(
                self.engine.model, self._kv_rotation_wanted(), self.engine.dtype
            )
            self.kv = self._allocate_kv_cache(self.kv_cache_config)
            self.core = EngineCore(
                self.engine.model,
                self.config,
                self.kv,
                self.tokenizer,
                limits,
                self.kv_cache_config,
                scheduler_config or SchedulerConfig(),
                seed,
            )
            # the host prepares and finishes one step while the GPU runs the next (None: on CUDA)
            if overlap_scheduling is None:
                overlap_scheduling = cuda
            self.core.overlap = overlap_scheduling
            self.kernel_warmup: dict[str, Any] | None = None
            self.cuda_graph_capture_s: float | None = None
            sizes = [] if enforce_eager else self._graph_sizes(cuda_graph_batch_sizes)
            if dry and record is not None:
                preload = self._dry_run(record, sizes)
            if cuda:
                self._warm_and_capture(kernel_warmup, sizes)
        if record is not None and self.kernel_warmup is not None:
            self.kernel_warmup |= {"preload": preload, "record": record.save()}
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._driver: asyncio.Task[None] | None = None
        # failures of engine steps under generate_async (kiln serve's /health reports them)
        self.step_failures = 0
        self.last_step_error: str | None = None
        self.dead: str | None = None  # set when even the clean-up step after a failure fails

    def _graph_sizes(self, graph_sizes: list[int] | None) -> list[int]:
        """The decode batch sizes captured as CUDA graphs: ``graph_sizes``, else those
        tuning.json chose, else the defaults; each at most the engine's batch limit."""
        limit = self.engine.limits["max_batch_size"]
        sizes = (
            graph_sizes
            or (self.engine.tuning or {}).get("cuda_graph_batch_sizes")
            or default_batch_sizes(limit)
        )
        return sorted({min(s, limit) for s in sizes if s >= 1})

    def _dry_run(self, record: KernelRecord, sizes: list[int]) -> dict[str, Any]:
        """A first load's variants recorded by a dry run of its warm-up and graph forwards
        and compiled at once (``kiln.runtime.warmup.dry_run``): the preload's figures."""
        start = time.perf_counter()
        with record.deferring():
            try:
                dry_run(self.core.runner, self.kv, self.engine.limits,
                        self.config.vocab_size, not sizes, sizes, self.max_seq_len)  # fmt: skip
            except Exception as exc:  # what it missed compiles in the warm-up, as without it
                log.warning("the load's dry run stopped early: %s", exc)
        dry = round(time.perf_counter() - start, 3)
        return record.preload(compile_workers()) | {"dry_run_s": dry}

    def _warm_and_capture(self, warmup: bool, sizes: list[int]) -> None:
        """GPU only. The Triton variants eager steps and the sampler can reach, compiled now
        rather than while requests wait (``kiln.runtime.warmup``), then the decode steps as
        CUDA graphs at ``sizes`` (none: every step eager)."""
        limits = self.engine.limits
        stage, largest = "the kernel warm-up", limits["max_batch_size"]
        try:
            if warmup:
                self.kernel_warmup = warm_up_kernels(
                    self.core.runner, self.kv, limits, self.config.vocab_size, not sizes
                )
            if sizes:
                stage, largest = "capturing the decode steps as CUDA graphs", sizes[-1]
                self.cuda_graph_capture_s = self.core.runner.capture_cuda_graphs(
                    self.max_seq_len, sizes
                )
        except torch.OutOfMemoryError as e:
            raise load_out_of_memory(
                stage, self.kv, self.kv_cache_config, self.engine.device, largest
            ) from e

    def _kv_dtype(self, requested: str | None) -> tuple[str | None, list[list[float]] | None]:
        """The KV cache's dtype (None or "fp8") and per-layer scales: the manifest's
        ``quant.kv_cache_dtype`` / ``quant.kv_scales`` first, the argument otherwise."""
        quant = self.engine.manifest.get("quant") or {}
        built = quant.get("kv_cache_dtype")
        if built == "fp8":
            return "fp8", quant.get("kv_scales")
        if requested is not None and built is not None:
            raise ConfigError(
                f"this engine was built with kv_cache_dtype={built!r}; "
                f"kv_cache_dtype={requested!r} cannot override it"
            )
        return requested, quant.get("kv_scales") if requested == "fp8" else None

    def _kv_rotation_wanted(self) -> bool:
        """q and k are rotated for an fp8 cache whose scales were calibrated so (the
        manifest's ``quant.kv_rotation``), or that has no calibrated scales; engines built
        before the rotation existed, and scales from a checkpoint, keep unrotated keys."""
        if self.kv_cache_dtype != "fp8":
            return False
        quant = self.engine.manifest.get("quant") or {}
        if quant.get("kv_cache_dtype") == "fp8":
            return quant.get("kv_rotation") == "hadamard"
        return self.kv_scales is None

    def _allocate_kv_cache(self, kc: KvCacheConfig) -> KVCache:
        kv_dtype = self.kv_cache_dtype
        per_token = kv_bytes_per_token(self.config, kv_storage_dtype(self.engine.dtype, kv_dtype))
        self.activation_peak_bytes = 0  # measured on a GPU when the cache is sized to fit
        self.free_bytes_at_kv_sizing = 0  # what the GPU had free then (the budget's base)
        # torch's caching allocator then: held from the GPU / in live tensors (the difference
        # is cached blocks that empty_cache could not give back)
        self.torch_bytes_at_kv_sizing = {"reserved": 0, "allocated": 0}
        if kc.max_tokens is not None:
            tokens = kc.max_tokens
        elif self.engine.device.type == "cuda":
            e = self.engine
            self.activation_peak_bytes = measure_activation_peak(
                e.model, self.config, e.dtype, e.device, e.limits, kc.tokens_per_block, kv_dtype
            )
            free, _ = torch.cuda.mem_get_info(e.device)
            self.free_bytes_at_kv_sizing = free
            reserved = torch.cuda.memory_reserved(e.device)
            allocated = torch.cuda.memory_allocated(e.device)
            self.torch_bytes_at_kv_sizing = {"reserved": reserved, "allocated": allocated}
            peak, fraction = self.activation_peak_bytes, kc.free_gpu_memory_fraction
            tokens = kv_budget_bytes(free, reserved, allocated, peak, fraction) // per_token
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
            self.config,
            num_blocks,
            kc.tokens_per_block,
            self.engine.dtype,
            self.engine.device,
            kv_dtype,
            self.kv_scales,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.tokens_per_block

    # ---- requests ---------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) with in-flight batching; outputs
        keep the prompts' order. Every request is validated before any runs."""
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
        if self._driver is not None:
            raise ConfigError(
                "LLM.generate cannot run while generate_async requests are in flight; "
                "await them first or use generate_async."
            )
        reqs = [self.core.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for r in reqs:
            self.core.add_request(r)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(reqs), desc="generating", unit="req", disable=not use_tqdm or len(reqs) < 2
        )
        try:
            while self.core.has_unfinished():
                for out in self.core.step(only_finished=True):
                    if out.finished:
                        final[out.request_id] = out
                        bar.update()
        except BaseException:
            for r in reqs:  # leave nothing behind: every block goes back to the pool
                self.core.abort(r.request_id)
            self.core.step()
            raise
        finally:
            bar.close()
        return [final[r.request_id] for r in reqs]

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

    async def generate_async(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request: yields a cumulative ``RequestOutput`` each time it advances,
        the last with ``finished=True``. Leaving the loop early aborts the request and frees
        its blocks. Raises ``ConfigError`` for invalid input before anything runs, and
        ``EngineDeadError`` once the engine cannot step any more."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        req = self.core.make_request(prompt, sampling_params or SamplingParams(), request_id)
        if req.request_id in self._queues:
            raise bad_value("request_id", req.request_id, "it is already in flight")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[req.request_id] = queue
        self.core.add_request(req)
        self._ensure_driver()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(req.request_id, None)
            if not finished:
                self.core.abort(req.request_id)
                self._ensure_driver()

    def abort(self, request_id: str) -> None:
        """Abort a request started with ``generate_async``; its stream ends with
        ``finish_reason="abort"`` and its blocks return to the pool."""
        self.core.abort(request_id)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's blocks that no request holds (as after a fresh load):
        later prompts reuse nothing computed before. Returns how many blocks it forgot."""
        return self.core.blocks.reset_prefix_cache()

    def _ensure_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        """Step the engine in a worker thread while requests are in flight."""
        try:
            while self.core.has_unfinished():
                try:
                    outs = await asyncio.to_thread(self.core.step)
                except Exception as e:  # fail the requests in flight, keep the engine
                    self.step_failures += 1
                    self.last_step_error = f"{type(e).__name__}: {e}"
                    for rid, q in list(self._queues.items()):
                        self.core.abort(rid)
                        q.put_nowait(e)
                    try:  # the aborts free every block at this step
                        await asyncio.to_thread(self.core.step)
                    except Exception as e2:
                        self.dead = f"the engine failed twice in a row ({type(e2).__name__}: {e2})"
                        for q in list(self._queues.values()):
                            q.put_nowait(EngineDeadError(self.dead))
                        return
                    continue
                for out in outs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
        finally:
            self._driver = None
