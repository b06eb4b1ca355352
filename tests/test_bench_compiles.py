"""``kiln.runtime.compiles``: the Triton variants first loaded inside a benchmark's timed
window, counted through Triton's JIT hooks (on the CPU the interpreter compiles nothing, so
the hooks are called here as Triton calls them; the GPU throughput runs report real counts)."""

from __future__ import annotations

from types import SimpleNamespace

from triton import knobs

from kiln.runtime.compiles import count_compiles


def _fire(name: str, key: str) -> None:
    fn = SimpleNamespace(module=None, name=name, jit_function=None)
    knobs.runtime.jit_cache_hook(key=key, repr="", fn=fn, compile={}, is_manual_warmup=False,
                                 already_compiled=False)  # fmt: skip
    knobs.runtime.jit_post_compile_hook(key=key, repr="", fn=fn, compile={},
                                        is_manual_warmup=False, already_compiled=False)  # fmt: skip


def test_counts_variants_and_restores_hooks() -> None:
    seen: list[str] = []
    before_cache, before_post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

    def outer_cache(**kw):  # a hook someone installed earlier keeps being called
        seen.append("cache:" + kw["fn"].name)
        return None

    knobs.runtime.jit_cache_hook = outer_cache
    try:
        with count_compiles() as log:
            assert log is not None
            _fire("_prefill_kernel", "k1")
            _fire("_prefill_kernel", "k2")
            _fire("_rotary_kv_kernel", "k1")
        assert log.count == 3 and log.seconds >= 0.0
        assert log.figures()["by_kernel"] == {"_prefill_kernel": 2, "_rotary_kv_kernel": 1}
        assert seen == ["cache:_prefill_kernel", "cache:_prefill_kernel", "cache:_rotary_kv_kernel"]
        assert knobs.runtime.jit_cache_hook is outer_cache
        assert knobs.runtime.jit_post_compile_hook is before_post
    finally:
        knobs.runtime.jit_cache_hook = before_cache
    with count_compiles() as log:
        pass
    assert log.figures() == {"count": 0, "seconds": 0.0, "by_kernel": {}}
