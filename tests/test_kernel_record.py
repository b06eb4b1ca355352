"""``kiln.runtime.kernel_record``: what a load records of the Triton variants it compiled,
what a later load trusts of that record, and the threaded preload through Triton's own
``AsyncCompileMode`` (with stand-in kernels on the CPU; the GPU test runs two loads of a
real engine, each with an empty Triton cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kiln.runtime.kernel_record as kr
from kiln.errors import ConfigError
from kiln.runtime.kernel_record import KernelRecord, compile_workers, resolve


def _hook_kw(module: str, name: str, spec: str, source_key: str = "k1") -> dict[str, Any]:
    jit = SimpleNamespace(cache_key=source_key)
    return {"fn": SimpleNamespace(module=module, name=name, jit_function=jit),
            "compile": {"specialization_data": spec}}  # fmt: skip


class FakeKernel:
    """Stands in for a JITFunction: ``preload`` submits a compile to the active
    ``AsyncCompileMode`` as Triton's ``_do_compile`` does."""

    def __init__(self, cache_key: str = "k1", fail: bool = False) -> None:
        self.cache_key, self.fail = cache_key, fail
        self.threads: list[str] = []
        self.finalized: list[str] = []

    def preload(self, spec: str) -> Any:
        from triton.runtime import _async_compile

        mode = _async_compile.active_mode.get()
        assert mode is not None, "preload must run under AsyncCompileMode"

        def compile_() -> str:
            self.threads.append(threading.current_thread().name)
            if self.fail:
                raise RuntimeError("ptxas said no")
            return f"compiled {spec}"

        return mode.submit(spec, compile_, self.finalized.append)


def test_record_keeps_kiln_variants_once_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "eng" / kr.RECORD_DIR / "triton-3.6.0-sm90.json"
    (tmp_path / "eng").mkdir()
    rec = KernelRecord(path)
    assert rec.entries == {} and rec.problem is None and rec.save() == "unchanged"
    rec.add(_hook_kw("kiln.kernels.decode_attention", "_decode_partial", '{"a": 1}'))
    rec.add(_hook_kw("kiln.kernels.decode_attention", "_decode_partial", '{"a": 1}'))
    rec.add(_hook_kw("kiln.kernels.sampling", "_sample_kernel", '{"b": 2}', "k2"))
    rec.add(_hook_kw("torch._inductor.x", "triton_poi_fused", '{"c": 3}'))  # not kiln's
    rec.add({"fn": None, "compile": {}})  # nothing to record
    assert rec.new == 2
    assert rec.save() == str(path) and rec.new == 0
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert not [p for p in path.parent.iterdir() if p.suffix == ".tmp"]
    again = KernelRecord(path)
    assert again.entries == rec.entries
    assert again.entries['{"b": 2}'] == {"module": "kiln.kernels.sampling",
                                          "name": "_sample_kernel", "source_key": "k2",
                                          "spec": '{"b": 2}'}  # fmt: skip
    assert again.save() == "unchanged"  # nothing new: the file is not rewritten


def test_record_path_names_triton_and_the_gpu(tmp_path: Path) -> None:
    p = kr.record_path(tmp_path, "3.6.0", (9, 0))
    assert p == tmp_path / "kernel_variants" / "triton-3.6.0-sm90.json"


def test_a_record_that_cannot_be_written_says_why(tmp_path: Path) -> None:
    blocker = tmp_path / "eng"
    blocker.write_text("a file where the engine directory should be")
    rec = KernelRecord(blocker / kr.RECORD_DIR / "x.json")
    rec.add(_hook_kw("kiln.kernels.rmsnorm", "_rmsnorm", "{}"))
    assert rec.save().startswith("not written")
    assert rec.new == 1  # kept, so a later save may still write it


@pytest.mark.parametrize("text", ["{not json", '{"variants": 3}', '{"other": []}', "[1]"])
def test_an_unreadable_record_is_ignored_and_reported(tmp_path: Path, text: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(text)
    rec = KernelRecord(path)
    assert rec.entries == {} and rec.problem and "unreadable record r.json" in rec.problem
    out = rec.preload(2)
    assert out["problem"] == rec.problem and out["compiled"] == 0


def test_resolve_trusts_only_kiln_kernels_unchanged_since_recorded(monkeypatch) -> None:
    import kiln.kernels.rmsnorm as mod

    monkeypatch.setattr(mod, "_fake_kernel", FakeKernel("k1"), raising=False)
    base = {"module": "kiln.kernels.rmsnorm", "name": "_fake_kernel", "source_key": "k1",
            "spec": "{}"}  # fmt: skip
    assert isinstance(resolve(base), FakeKernel)
    cases = [
        ({"module": "os", "name": "system"}, "not a kiln module"),
        ({"module": "kilnx.evil", "name": "f"}, "not a kiln module"),
        ({"name": "make.<locals>.kernel"}, "not a module-level name"),
        ({"name": "_no_such_kernel"}, "no such kernel"),
        ({"module": "kiln.no_such_module"}, "no such kernel"),
        ({"name": "torch"}, "not a Triton kernel"),  # a module attribute, not a kernel
        ({"source_key": "k0"}, "changed since it was recorded"),
        ({"spec": None}, "no specialization"),
    ]
    for change, why in cases:
        assert resolve(base | change) == why, change


def test_preload_compiles_in_worker_threads_and_counts_what_it_skipped(monkeypatch) -> None:
    import kiln.kernels.rmsnorm as mod

    good, bad = FakeKernel("k1"), FakeKernel("k1", fail=True)
    monkeypatch.setattr(mod, "_fake_good", good, raising=False)
    monkeypatch.setattr(mod, "_fake_bad", bad, raising=False)
    with tempfile.TemporaryDirectory() as d:
        rec = KernelRecord(Path(d) / "r.json")
        for i in range(5):
            rec.add(_hook_kw("kiln.kernels.rmsnorm", "_fake_good", f'{{"v": {i}}}'))
        rec.add(_hook_kw("kiln.kernels.rmsnorm", "_fake_bad", '{"v": "bad"}'))
        rec.add(_hook_kw("kiln.kernels.rmsnorm", "_fake_good", '{"v": "old"}', "k0"))
        out = rec.preload(3)
    assert out["compiled"] == 5 and out["failed"] == 1, out
    assert out["skipped"] == {"changed since it was recorded": 1}, out
    assert out["recorded"] == 7 and out["workers"] == 3
    assert sorted(good.finalized) == [f'compiled {{"v": {i}}}' for i in range(5)]
    assert bad.finalized == []  # a failed compile is left to the launch
    main = threading.main_thread().name
    assert good.threads and main not in good.threads  # compiled in the pool, not here
    off = KernelRecord(Path("/nonexistent/r.json"))
    assert off.preload(0) == {"recorded": 0, "workers": 0, "compiled": 0, "seconds": 0.0}


def test_recording_chains_the_hook_already_installed() -> None:
    from triton import knobs

    seen: list[Any] = []
    prev = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *a, **kw: seen.append(kw) or "prev-result"
    try:
        rec = KernelRecord(Path("/nonexistent/r.json"))
        with rec.recording():
            kw = _hook_kw("kiln.kernels.rmsnorm", "_rmsnorm", '{"z": 1}')
            assert knobs.runtime.jit_cache_hook(**kw) == "prev-result"
        assert len(seen) == 1 and rec.new == 1
        assert knobs.runtime.jit_cache_hook is not None
        knobs.runtime.jit_cache_hook(**_hook_kw("kiln.x", "y", '{"z": 2}'))
        assert rec.new == 1  # the record's hook is gone after the block
    finally:
        knobs.runtime.jit_cache_hook = prev


def test_compile_workers_setting() -> None:
    assert compile_workers({"KILN_COMPILE_WORKERS": "0"}) == 0
    assert compile_workers({"KILN_COMPILE_WORKERS": "12"}) == 12
    assert 1 <= compile_workers({}) <= 32
    with pytest.raises(ConfigError, match=r"KILN_COMPILE_WORKERS='many' is invalid.*0 to 256"):
        compile_workers({"KILN_COMPILE_WORKERS": "many"})


_LOAD = """
import json, sys
from kiln import LLM, SamplingParams
llm = LLM("dummy:tiny", max_seq_len=512, max_batch_size=16, max_num_tokens=512,
          progress=False)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0),
                   use_tqdm=False)
print(json.dumps({"warmup": llm.kernel_warmup, "tokens": out[0].outputs[0].token_ids}))
"""


@pytest.mark.gpu
def test_second_load_on_a_cold_triton_cache_compiles_the_record_in_threads(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runs = []
    for i in range(3):  # each load with an empty Triton cache, the same engine; the third
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env |= {"KILN_CACHE_DIR": str(tmp_path / "kiln"), "KILN_LOAD_DRY_RUN": str(i // 2),
                "TRITON_CACHE_DIR": str(tmp_path / f"triton{i}")}  # fmt: skip
        if i == 2:  # ... without the record, after a dry run (kiln.runtime.warmup.dry_run)
            recorded = Path(runs[0]["warmup"]["record"])
            recorded.unlink()
        proc = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True,
                              text=True, timeout=900, cwd=Path(__file__).parents[1])  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.splitlines()[-1]))
    first, second, third = (r["warmup"] for r in runs)
    print(json.dumps({"first": first, "second": second, "third": third}))  # the figures
    assert first["preload"]["recorded"] == 0 and first["variants"] > 0
    assert first["record"].endswith("sm90.json") or "kernel_variants" in first["record"]
    pre = second["preload"]
    assert pre["recorded"] > 0 and pre["compiled"] == pre["recorded"], pre
    if "in_processes" in pre:  # 8 CPUs or more: the processes compiled them all first
        assert pre["in_processes"]["compiled"] == pre["recorded"], pre
        assert pre["disk_hits"] == pre["recorded"], pre
    assert second["variants"] == 0, second  # the warm-up found every variant compiled
    assert second["record"] == "unchanged"
    assert runs[0]["tokens"] == runs[1]["tokens"]
    dry = third["preload"]  # the dry run found what the warm-up needs, compiled at once
    assert dry["dry_run_s"] > 0 and dry["recorded"] > 0 and dry["compiled"] == dry["recorded"]
    assert third["variants"] == 0, third
    assert json.loads(recorded.read_text())["variants"], third["record"]
    assert runs[2]["tokens"] == runs[0]["tokens"]


_REAL = """
import json, os, sys, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import MockTensor


class SM90:  # Triton's driver API as far as compiling needs it: an sm_90 device 0
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(SM90())
from kiln.kernels.rmsnorm import _rms_norm_kernel as fn
from kiln.runtime.compiles import count_compiles
from kiln.runtime.kernel_record import KernelRecord


def warm(block, residual=True):
    t = MockTensor(torch.bfloat16)
    fn.warmup(t, t, t, t, t, 4096, 4096, 4096, 4096, 4096, 1e-5, 0, HAS_RESIDUAL=residual,
              BLOCK=block, grid=(1,), num_warps=16)


path = sys.argv[1]
rec = KernelRecord(__import__("pathlib").Path(path))
with rec.recording():
    warm(4096)
    warm(4096, residual=False)
saved = rec.save()
fn.device_caches.clear()  # as a new process: nothing compiled in memory
pre = KernelRecord(__import__("pathlib").Path(path)).preload(2)
with count_compiles() as again:
    warm(4096)
    warm(4096, residual=False)
with count_compiles() as other:
    warm(2048)
print(json.dumps({"saved": saved, "new": rec.new, "entries": len(rec.entries), "pre": pre,
                  "again": again.count, "other": other.count}))
"""


def test_triton_preload_of_a_recorded_kiln_kernel_fills_its_cache(tmp_path: Path) -> None:
    """The real path on the CPU, compiling for sm_90 (Triton's driver stood in for): the
    record taken from Triton's hook while two variants of the RMSNorm kernel compile,
    then, with the kernel's in-memory cache emptied, ``preload`` in two threads; the same
    variants then compile nothing (the hook does not fire), another one does."""
    from tests import sm90

    got = sm90.run(_REAL, str(tmp_path / "rec.json"), timeout=600)
    assert got["saved"] == str(tmp_path / "rec.json") and got["entries"] == 2, got
    pre = got["pre"]
    assert pre["compiled"] == 2 and pre["failed"] == 0 and pre["skipped"] == {}, pre
    assert got["again"] == 0 and got["other"] == 1, got


_BUILT = (
    _REAL.split("path = sys.argv[1]")[0]
    + """
from pathlib import Path
from kiln.runtime.kernel_record import forget_compiled

warm(4096)  # compiled before the load (as an implicit build's tuning does)
warm(2048)
rec = KernelRecord(Path(sys.argv[1]))
with rec.recording():
    warm(2048)  # already in memory: the hook does not fire
missed = rec.new
forgotten = forget_compiled()
with count_compiles() as log, rec.recording():
    warm(4096)  # read back from Triton's disk cache: recorded
print(json.dumps({"missed": missed, "forgotten": forgotten, "new": rec.new,
                  "reread": log.count}))
"""
)


def test_variants_compiled_before_the_load_are_recorded_after_forget_compiled(
    tmp_path: Path,
) -> None:
    """The cause of the H200 failure of 2026-12-03 (4 variants compiled again by a second
    load): variants already in a kernel's memory when the load starts recording (an
    implicit build's tuning compiled them in the same process) never reach the record.
    ``forget_compiled`` empties kiln's kernels' in-memory caches, so the load reads them
    back from Triton's disk cache and the hook records them (CPU, compiling for sm_90)."""
    from tests import sm90

    got = sm90.run(_BUILT, str(tmp_path / "rec.json"), timeout=600)
    assert got["missed"] == 0, got  # the mechanism: nothing recorded for a cached variant
    assert got["forgotten"] >= 1 and got["new"] == 1 and got["reread"] == 1, got


_DEFER = (
    _REAL.split("path = sys.argv[1]")[0]
    + """
from kiln.runtime.kernel_record import precompile

cache = fn.device_caches[0][0]  # the kernel's in-memory variants
dry = {}


def work():
    warm(4096)
    warm(4096, residual=False)
    warm(4096)  # the same variant again: one entry
    dry["in_memory"] = len(cache)
    raise RuntimeError("a tuner's candidate failing its check")  # dropped, logged


with count_compiles() as during:
    pre = precompile(work, workers=2)
compiled = len(cache)
with count_compiles() as after:
    warm(4096)
    warm(4096, residual=False)
print(json.dumps({"pre": pre, "dry": dry, "compiled": compiled, "during": during.count,
                  "after": after.count}))
"""
)


def test_precompile_defers_new_variants_then_compiles_them_in_threads() -> None:
    """The tuner's precompile on the CPU (compiling for sm_90, Triton's driver stood in
    for): inside the dry run the RMSNorm kernel's two new variants are recorded but not
    compiled (nothing in memory), the repeat adds no entry and the exception is dropped;
    then both compile in the pool, once each, and later calls compile nothing."""
    from tests import sm90

    got = sm90.run(_DEFER, timeout=600)
    pre = got["pre"]
    assert got["dry"] == {"in_memory": 0}, got
    assert pre["recorded"] == 2 and pre["compiled"] == 2 and pre["failed"] == 0, pre
    assert pre["workers"] == 2 and pre["dry_run_s"] >= 0, pre
    assert got["compiled"] == 2 and got["during"] == 2 and got["after"] == 0, got


def test_an_in_memory_record_is_never_read_or_written() -> None:
    rec = KernelRecord(None)
    assert rec.entries == {} and rec.problem is None
    rec.add(_hook_kw("kiln.kernels.rmsnorm", "_rmsnorm", '{"z": 1}'))
    assert rec.new == 1 and rec.save() == "not written (in memory)"


def test_an_implicit_build_marks_its_engine_built_here(tmp_path: Path, monkeypatch) -> None:
    """``LLM`` empties the in-memory caches only after a build in this process: the cache
    names the engines it built."""
    from kiln.build import cache

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    from kiln.config import BuildConfig

    cfg = BuildConfig(device="cpu")
    path = cache.cached_engine("dummy:tiny", cfg, progress=False)
    assert path in cache.BUILT_HERE
    cache.BUILT_HERE.discard(path)
    assert cache.cached_engine("dummy:tiny", cfg, progress=False) == path  # cached: not built
    assert path not in cache.BUILT_HERE


_PROCS = (
    _REAL.split("path = sys.argv[1]")[0]
    + """
from triton import knobs

from kiln.kernels.wq_f16 import _wq4_f16_kernel as gfn


def warm_gluon():  # a Gluon kernel too: the float16-code int4 kernel at one row
    p = [MockTensor(d) for d in (torch.int32, torch.float32, torch.int32, torch.float16,
                                 torch.uint8, torch.bfloat16, torch.float32)]
    gfn.warmup(*p, 1, 4096, 4096, 2048, 32, 4096, 4096, 0x64006400, R=1, SPLIT_K=1,
               GROUP=128, NW=4, CH=1, PF=0, PDL=True, M1=True, EVEN=True, EVEN2=False,
               grid=(256, 1), num_warps=4)


rec = KernelRecord(None)
with rec.recording():
    warm(4096)
    warm(4096, residual=False)
    warm_gluon()
out = {}
for procs in (2, 0):  # each into an empty Triton cache, the kernels' memory emptied
    knobs.cache.dir = tempfile.mkdtemp()
    fn.device_caches.clear()
    gfn.device_caches.clear()
    out[procs] = rec.preload(2, processes=procs)
with count_compiles() as again:
    warm(4096)
    warm_gluon()
fn.device_caches.clear()  # the same (now warm) cache again: nothing left for processes
gfn.device_caches.clear()
warm_cache = rec.preload(2, processes=2)
print(json.dumps({"by_processes": out, "again": again.count, "warm": warm_cache}))
"""
)


def test_preload_compiles_in_processes_then_reads_them_from_disk() -> None:
    """Two recorded RMSNorm variants and one of the float16-code int4 kernel (Gluon; CPU,
    compiling for sm_90 with Triton's driver stood in for) preloaded into an empty Triton
    cache: with two worker processes, the processes compile all three and the threads then
    find them on disk (cache hits: the same keys); without processes the threads compile
    them. Either way the kernels then compile nothing. On the warm cache the lookup finds
    all three, so no process has anything to compile."""
    from tests import sm90

    got = sm90.run(_PROCS, timeout=600)
    with_procs, threads_only = got["by_processes"]["2"], got["by_processes"]["0"]
    procs = with_procs["in_processes"]
    assert (procs["processes"], procs["compiled"], procs["failed"]) == (2, 3, 0), with_procs
    assert with_procs["missing_on_disk"] == 3, with_procs
    assert with_procs["compiled"] == 3 and with_procs["disk_hits"] == 3, with_procs
    assert "in_processes" not in threads_only, threads_only
    assert threads_only["compiled"] == 3 and threads_only["disk_hits"] == 0, threads_only
    assert got["again"] == 0, got
    # a warm cache: the lookup (triton.compile's key) finds all three, no process compiles
    warm = got["warm"]
    assert warm["missing_on_disk"] == 0 and warm["in_processes"]["compiled"] == 0, warm
    assert warm["compiled"] == 3 and warm["disk_hits"] == 3, warm


def test_compile_processes_default_and_setting() -> None:
    """``KILN_COMPILE_PROCESSES`` is taken as given (at most one a variant); by default
    processes only with at least 8 CPUs and 128 variants, one per 8 variants, at most
    32."""
    from kiln.runtime import compile_procs as cp

    assert cp.compile_processes(100, {"KILN_COMPILE_PROCESSES": "0"}) == 0
    assert cp.compile_processes(100, {"KILN_COMPILE_PROCESSES": "3"}) == 3
    assert cp.compile_processes(2, {"KILN_COMPILE_PROCESSES": "3"}) == 2
    cpus = cp._cpus()
    assert cp.compile_processes(239, {}) == (min(32, cpus, 239 // 8) if cpus >= 8 else 0)
    assert cp.compile_processes(127, {}) == 0
    assert cp.compile_processes(3, {}) == 0
    with pytest.raises(Exception, match="KILN_COMPILE_PROCESSES"):
        cp.compile_processes(100, {"KILN_COMPILE_PROCESSES": "x"})


def test_compile_processes_do_not_run_the_callers_script(tmp_path: Path) -> None:
    """The workers are fresh interpreters (``python -m kiln.runtime.compile_procs``): a
    caller's script without a ``__main__`` guard (as a user's ``LLM(...)`` script may be)
    runs once, not once more in every worker as ``multiprocessing``'s spawn would."""
    script = tmp_path / "user_script.py"
    marker = tmp_path / "runs.txt"
    script.write_text(
        f"open({str(marker)!r}, 'a').write('run\\n')\n"
        + _PROCS.replace("for procs in (2, 0):", "for procs in (2,):")
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["by_processes"]["2"]["in_processes"]["compiled"] == 3, got
    assert marker.read_text() == "run\n"


def test_a_record_the_engine_directory_cannot_take_goes_to_the_cache(tmp_path: Path) -> None:
    # a file where kernel_variants/ should be: the engine directory cannot take the record
    # (root ignores read-only modes, so this stands in for a read-only mount)
    eng = tmp_path / "eng"
    eng.mkdir()
    (eng / kr.RECORD_DIR).write_text("not a directory")
    (eng / "manifest.json").write_text('{"a": 1}')
    path = kr.record_path(eng, "3.6.0", (9, 0))
    fallback = kr.fallback_path(eng, "3.6.0", (9, 0), tmp_path / "cache")
    assert fallback.is_relative_to(tmp_path / "cache" / kr.RECORD_DIR)
    assert fallback.name == path.name
    rec = KernelRecord(path, fallback)
    rec.add(_hook_kw("kiln.kernels.rmsnorm", "_rmsnorm", '{"s": 1}'))
    said = rec.save()
    assert said.startswith(f"{fallback} (the engine directory's: ") and rec.new == 0
    assert fallback.is_file() and not path.exists()
    again = KernelRecord(path, fallback)  # the next load finds it: no dry run, a preload
    assert again.entries == rec.entries and again.problem is None
    # keyed by the engine's path and manifest: a rebuilt engine starts a new record
    (eng / "manifest.json").write_text('{"a": 2}')
    assert kr.fallback_path(eng, "3.6.0", (9, 0), tmp_path / "cache") != fallback
    other = tmp_path / "eng2"
    other.mkdir()
    (other / "manifest.json").write_text('{"a": 2}')
    assert kr.fallback_path(other, "3.6.0", (9, 0), tmp_path / "cache") != kr.fallback_path(
        eng, "3.6.0", (9, 0), tmp_path / "cache"
    )


def test_a_record_written_nowhere_says_both_reasons_and_keeps_its_entries(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rec = KernelRecord(blocker / "eng" / "r.json", blocker / "cache" / "r.json")
    rec.add(_hook_kw("kiln.kernels.rmsnorm", "_rmsnorm", "{}"))
    said = rec.save()
    assert said.startswith("not written (") and "; nor " in said and rec.new == 1


def test_the_engines_record_and_the_caches_are_read_together(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    ea = {"module": "kiln.x", "name": "k", "source_key": "1", "spec": "A"}
    eb = {"module": "kiln.x", "name": "k", "source_key": "1", "spec": "B"}
    a.write_text(json.dumps({"variants": [ea]}))
    b.write_text(json.dumps({"variants": [eb, ea]}))
    assert KernelRecord(a, b).entries == {"A": ea, "B": eb}
    b.write_text("{broken")
    rec = KernelRecord(a, b)
    assert rec.entries == {"A": ea} and "unreadable record b.json" in (rec.problem or "")
