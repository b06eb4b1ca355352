"""The device's ceilings: memory copy bandwidth and matrix-multiply rates.

``measure`` times, on the device itself:

- a large device-to-device copy (GPU: 2 GiB; CPU: 256 MiB), counting the bytes read plus
  the bytes written;
- square matrix products, ``2 n^3`` operations each: on a GPU 8192^3 in bfloat16 and
  float16, float32 (TF32 off, the default), and float8 e4m3 through ``torch._scaled_mm``
  when the compute capability is at least 8.9; on the CPU 1024^3 float32 and 512^3
  bfloat16.

The best of several repetitions is kept (after a warm-up). Results are cached as JSON under
``$KILN_CACHE_DIR/ceilings/`` per device name and torch version, so a benchmark measures
them once per machine; ``kiln bench ceilings --refresh`` measures again.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kiln.build.cache import cache_root

GIB = 1 << 30


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name with the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def cache_path(device: torch.device) -> Path:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{device_name(device)}-torch{torch.__version__}")
    return cache_root() / "ceilings" / f"{slug.strip('-')}.json"


def _timer(device: torch.device, fn: Callable[[], Any], reps: int) -> float:
    """Best seconds of one call of ``fn`` over ``reps`` runs, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """Bytes per second of ``dst.copy_(src)``, read + write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    t = _timer(device, lambda: dst.copy_(src), reps)

    return 2 * nbytes / t


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype, reps: int) -> float:
    """FLOP/s of an ``n x n @ n x n`` product in ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    t = _timer(device, lambda: a @ b, reps)
    return 2 * n**3 / t


def fp8_matmul_rate(device: torch.device, n: int, reps: int) -> float:
    """FLOP/s of an e4m3 ``torch._scaled_mm`` (bfloat16 output, per-tensor scales)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device, dtype=torch.float32)
    # the second operand must be column-major: the transpose of a row-major matrix
    t = _timer(
        device,
        lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        reps,
    )
    return 2 * n**3 / t


def measure(device: torch.device, quick: bool = False) -> dict[str, Any]:
    """Measure the ceilings of ``device`` (``quick``: smaller sizes, for tests)."""
    gpu = device.type == "cuda"
    reps = 3 if quick else (10 if gpu else 5)
    copy_bytes = (256 << 20 if quick else 2 * GIB) if gpu else (32 << 20 if quick else 256 << 20)
    n = (4096 if quick else 8192) if gpu else (512 if quick else 1024)
    rates: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    dtypes = ("bfloat16", "float16", "float32") if gpu else ("float32", "bfloat16")
    t0 = time.perf_counter()
    bw = copy_bandwidth(device, copy_bytes, reps)
    for name in dtypes:
        # CPUs without bf16 matrix units run bfloat16 ~50x slower: a smaller product suffices
        size = n // 2 if not gpu and name == "bfloat16" else n
        rates[name] = matmul_rate(device, size, getattr(torch, name), reps)
    if gpu:
        cc = torch.cuda.get_device_capability(device)
        if cc >= (8, 9):
            try:
                rates["float8_e4m3"] = fp8_matmul_rate(device, n, reps)
            except (RuntimeError, AttributeError) as e:  # no fp8 GEMM in this torch build
                rates["float8_e4m3"] = None
                notes["float8_e4m3"] = f"{type(e).__name__}: {str(e)[:200]}"
        else:
            notes["float8_e4m3"] = f"compute capability {cc[0]}.{cc[1]} < 8.9"
        torch.cuda.empty_cache()
    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "measure_time_s": time.perf_counter() - t0,
        "copy_bytes": copy_bytes,
        "matmul_n": n,
        "copy_bandwidth_bytes_per_s": bw,
        "matmul_flops_per_s": rates,
        "notes": notes,
    }


def get(device: torch.device, refresh: bool = False, quick: bool = False) -> dict[str, Any]:
    """Cached ceilings of ``device``, measured (and cached) when absent or ``refresh``."""
    path = cache_path(device)
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("copy_bandwidth_bytes_per_s"):
                data["cached"] = str(path)
                return data
        except (OSError, ValueError):
            pass
    data = measure(device, quick=quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    data["cached"] = None
    return data


def rate_for(ceilings: dict[str, Any], dtype: torch.dtype) -> float:
    """The matmul rate for an engine dtype (float32 when that dtype was not measured)."""
    rates = ceilings["matmul_flops_per_s"]
    name = str(dtype).removeprefix("torch.")
    return rates.get(name) or rates["float32"]


def print_ceilings(device: str, refresh: bool, as_json: bool) -> int:
    """``kiln bench ceilings``: the device's ceilings (measured once, then cached), printed."""
    from kiln.build.target import resolve_device

    dev = torch.device(resolve_device(device))
    c = get(dev, refresh=refresh)
    if as_json:
        print(json.dumps(c, indent=2))
        return 0
    print(f"device      {c['device']} (torch {c['torch']}, measured {c['measured']})")
    print(f"copy        {c['copy_bandwidth_bytes_per_s'] / 1e9:,.1f} GB/s (read + write)")
    for name, rate in c["matmul_flops_per_s"].items():
        if rate is None:
            print(f"matmul      {name:<12} -")
        elif rate >= 1e12:
            print(f"matmul      {name:<12} {rate / 1e12:,.1f} TFLOP/s")
        else:
            print(f"matmul      {name:<12} {rate / 1e9:,.1f} GFLOP/s")
    for name, note in c["notes"].items():
        print(f"note        {name}: {note}")
    print(f"cache       {c['cached'] or cache_path(dev)}")
    return 0
