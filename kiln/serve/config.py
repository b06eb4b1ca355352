"""``ServeConfig``: every option of ``kiln serve``, from defaults, a YAML file and flags.

Precedence: defaults < the YAML file (``--config``) < flags given on the command line. The
API key also comes from ``$KILN_API_KEY`` when neither the file nor a flag sets it. YAML keys
are the field names below (``max_queued_requests``) or the flag spelling
(``max-queued-requests``); an unknown key is an error, so a typo never goes unnoticed. The
file is read with ``yaml.safe_load`` (no Python objects, no code)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.config import KvCacheConfig, check_memory_fraction
from kiln.errors import ConfigError, bad_value
from kiln.quant.cli_options import LOAD_KV_CACHE_DTYPES

API_KEY_ENV = "KILN_API_KEY"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServeConfig:
    """Options of the server. ``model`` is anything ``kiln.LLM`` accepts (None: the embedded
    SmolLM2-135M-Instruct)."""

    model: str | None = None
    served_model_name: str | None = None  # the id in /v1/models (default: from ``model``)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int = 256  # engine requests waiting for a slot; past it: 429
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for requests in flight
    max_n: int = 16  # choices per request (n times the number of prompts)
    max_body_bytes: int = 1 << 20  # request bodies past it: 413
    max_header_count: int = 100  # more headers: 431
    max_header_bytes: int = 16384  # header bytes past it: 431
    max_model_len: int | None = None  # prompt + max_tokens cap (default: engine max_seq_len)
    max_stop_strings: int = 16
    reject_unknown_fields: bool = False  # False: ignore (and log) unknown body fields
    log_level: str = "info"
    # build / load options passed to kiln.LLM
    dtype: str = "auto"
    device: str = "auto"
    max_batch_size: int = 64
    max_seq_len: int | None = None
    max_num_tokens: int = 8192
    kv_cache_max_tokens: int | None = None
    # of the memory left after a step's peak
    kv_cache_free_gpu_memory_fraction: float = KvCacheConfig.free_gpu_memory_fraction
    kv_cache_dtype: str = "auto"  # "fp8": an fp8 cache for an engine built without one
    enable_prefix_caching: bool = True  # reuse computed prompt blocks across requests
    enforce_eager: bool = False  # no CUDA graphs
    scheduler_policy: str = "guaranteed_no_evict"
    seed: int = 0

    def __post_init__(self) -> None:
        positive = (
            "port",
            "max_n",
            "max_body_bytes",
            "max_header_count",
            "max_header_bytes",
            "max_batch_size",
            "max_num_tokens",
            "max_stop_strings",
        )
        for name in positive:
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise bad_value(name, v, "a positive integer is required")
        if self.port > 65535:
            raise bad_value("port", self.port, "an integer in [1, 65535] is required")
        if not _is_int(self.max_queued_requests) or self.max_queued_requests < 0:
            raise bad_value(
                "max_queued_requests", self.max_queued_requests, "an integer >= 0 is required"
            )
        for name in ("max_model_len", "max_seq_len", "kv_cache_max_tokens"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 2):
                raise bad_value(name, v, "None or an integer >= 2 is required")
        t = self.shutdown_timeout
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise bad_value("shutdown_timeout", t, "a finite number of seconds >= 0 is required")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise bad_value("api_key", "<hidden>", "a non-empty string or None is required")
        f = self.kv_cache_free_gpu_memory_fraction
        check_memory_fraction("kv_cache_free_gpu_memory_fraction", f)
        if self.kv_cache_dtype not in LOAD_KV_CACHE_DTYPES:
            allowed = f"one of {', '.join(LOAD_KV_CACHE_DTYPES)}"
            raise bad_value("kv_cache_dtype", self.kv_cache_dtype, allowed)
        for name in ("enable_prefix_caching", "enforce_eager", "reject_unknown_fields"):
            if not isinstance(getattr(self, name), bool):
                raise bad_value(name, getattr(self, name), "true or false")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise bad_value(
                "log_level", self.log_level, "one of critical, error, warning, info, debug"
            )

    @property
    def model_name(self) -> str:
        """The model id clients pass and /v1/models lists."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return EMBEDDED_MODEL_NAME
        if self.model.startswith("dummy:"):
            return self.model
        name = Path(self.model).expanduser().name
        return name.removesuffix(".gguf") or self.model

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``kiln.LLM`` (besides ``model``)."""
        from kiln.config import SchedulerConfig

        kv = KvCacheConfig(
            max_tokens=self.kv_cache_max_tokens,
            free_gpu_memory_fraction=self.kv_cache_free_gpu_memory_fraction,
            enable_block_reuse=self.enable_prefix_caching,
        )
        return {
            "dtype": self.dtype,
            "device": self.device,
            "max_batch_size": self.max_batch_size,
            "max_seq_len": self.max_seq_len,
            "max_num_tokens": self.max_num_tokens,
            "kv_cache_config": kv,
            "scheduler_config": SchedulerConfig(capacity_scheduler_policy=self.scheduler_policy),
            "seed": self.seed,
            "kv_cache_dtype": None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype,
            "enforce_eager": self.enforce_eager,
        }

    def public_dict(self) -> dict[str, Any]:
        """The options with the API key hidden (for logs)."""
        d = dataclasses.asdict(self)
        if d["api_key"]:
            d["api_key"] = "<set>"
        return d


FIELDS = {f.name for f in dataclasses.fields(ServeConfig)}


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Options from a YAML mapping; keys may use dashes or underscores."""
    import yaml

    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read the config file {p}: {e.strerror or e}.") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"the config file {p} is not valid YAML: {e}.") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"the config file {p} must hold a mapping of option: value.")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise bad_value(
                f"{p.name}: {key}", value, f"known options are {', '.join(sorted(FIELDS))}"
            )
        out[name] = value
    return out


def make_config(
    config_file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> ServeConfig:
    """Defaults < YAML file < ``overrides`` (flags given); the API key falls back to
    ``$KILN_API_KEY``."""
    values: dict[str, Any] = load_yaml(config_file) if config_file else {}
    values.update(overrides or {})
    env = os.environ if environ is None else environ
    if values.get("api_key") is None and env.get(API_KEY_ENV):
        values["api_key"] = env[API_KEY_ENV]
    return ServeConfig(**values)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
