"""``kiln.runtime.warmup``: the load-time warm-up's plan covers the shapes that pick Triton
variants, stays inside the engine's limits, runs through the model runner touching only
the KV cache's null block; on a GPU, requests after the load compile nothing."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ConfigError
from kiln.kernels.tuning import set_tuning, tuned
from kiln.llm import LLM
from kiln.runtime.warmup import (
    PDL_ROWS,
    ROW_SWEEP,
    WarmStep,
    dry_run,
    dry_run_wanted,
    run_warmup,
    warmup_plan,
)
from kiln.sampling_params import SamplingParams


@pytest.fixture
def tiers():
    """Decode attention tuned with small (<= 8) and medium (<= 64) tiers, as H200 builds."""
    base = tuned("decode_attention")
    small = {"max_batch": 8, "target_programs": 1056, "num_warps": 4, "blocks_per_step": 1}
    medium = {"max_batch": 64, "target_programs": 528, "num_warps": 4, "blocks_per_step": 2}
    set_tuning({"decode_attention": base | {"small_batch": small, "medium_batch": medium}})
    yield
    set_tuning(None)


def _inside(plan: list[WarmStep], max_batch: int, max_tokens: int, max_len: int) -> None:
    for s in plan:
        assert 1 <= s.rows <= max_tokens, s
        assert s.decodes + (1 if s.prefill else 0) <= max_batch, s
        assert 2 <= s.context <= max_len - 1 or not s.decodes, s
        assert s.prefix + s.prefill <= max_len - 1, s
        assert s.prefill != 1, s  # a one-token chunk would be taken for a decode


def test_plan_covers_rows_tiers_pdl_and_widths(tiers) -> None:
    plan = warmup_plan(2048, 16384, 4096, 32)
    _inside(plan, 2048, 16384, 4096)
    assert len(plan) == len(set(plan))
    mixed_rows = {s.rows for s in plan if s.decodes and s.prefill}
    decode_rows = {s.rows for s in plan if not s.prefill}
    assert set(range(3, ROW_SWEEP + 1)) <= mixed_rows
    assert set(range(1, ROW_SWEEP + 1)) <= decode_rows
    # with CUDA graphs, steps of decodes alone never run eagerly: not warmed
    graphed = warmup_plan(2048, 16384, 4096, 32, eager_decodes=False)
    assert not any(s.decodes and not s.prefill for s in graphed)
    assert {s for s in plan if s.prefill} == set(graphed)
    # each tier (1, 9, 65 decodes) at every block-table width, rows on both PDL sides
    widths = {1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128}
    for d in (1, 9, 65):
        seen = {(s.context, s.rows <= PDL_ROWS) for s in plan if s.decodes == d and s.prefill}
        ctxs = {c for c, _ in seen}
        assert {min(w * 32, 4095) for w in widths} - {32} <= ctxs | {32}, d
        if d < PDL_ROWS:
            assert {pdl for _, pdl in seen} == {True, False}, d
    # prompt chunks alone (fresh, and after cached prefixes), at integer classes
    fresh = {s.prefill for s in plan if s.prefill and not s.decodes and not s.prefix}
    assert {2, 16, 17, 129, 144} <= fresh
    assert {s.prefix for s in plan if s.prefix} >= {32, 64, 1024, 2048, 2080}


def test_plan_respects_small_limits(tiers) -> None:
    for limits in [(4, 64, 128, 16), (1, 8, 32, 16), (16, 100, 4096, 32), (64, 8192, 257, 16)]:
        plan = warmup_plan(*limits)
        assert plan
        _inside(plan, limits[0], limits[1], limits[2])


def test_warmup_runs_on_the_null_block_only() -> None:
    llm = LLM("dummy:tiny", device="cpu", max_seq_len=256, max_batch_size=8, max_num_tokens=160,
              enforce_eager=True, progress=False)  # fmt: skip
    kv = llm.kv
    plan = warmup_plan(8, 160, 256, kv.tokens_per_block)
    assert any(s.decodes and s.prefill for s in plan) and any(s.prefix for s in plan)
    for layer in kv.layers:
        layer.zero_()
    run_warmup(llm.core.runner, kv, plan)
    null = kv.null_block
    for layer in kv.layers:
        assert torch.count_nonzero(layer[:, :null]) == 0  # no block of the cache touched
        assert torch.count_nonzero(layer[:, null]) > 0  # the null block took the writes
    assert llm.core.runner.eager_steps == 0  # not counted as the engine's steps
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_dry_run_writes_the_null_block_only() -> None:
    """The load's dry run (the warm-up's steps and a forward at each graph size) on the
    CPU, where every kernel runs: only the null block written, the engine's greedy tokens
    unchanged after it."""
    llm = LLM("dummy:tiny", device="cpu", max_seq_len=256, max_batch_size=8, max_num_tokens=160,
              enforce_eager=True, progress=False)  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0)
    before = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    kv, steps = llm.kv, llm.core.runner.eager_steps
    for layer in kv.layers:
        layer.zero_()
    dry_run(llm.core.runner, kv, llm.engine.limits, llm.config.vocab_size, False, [1, 3, 8],
            llm.max_seq_len)  # fmt: skip
    for layer in kv.layers:
        assert torch.count_nonzero(layer[:, : kv.null_block]) == 0
        assert torch.count_nonzero(layer[:, kv.null_block]) > 0
    assert llm.core.runner.eager_steps == steps and llm.core.runner.graphs is None
    after = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


def test_load_dry_run_plumbing(monkeypatch, caplog) -> None:
    """``LLM._dry_run``: the dry run under the record's deferring hook, then the preload's
    figures with the dry run's seconds; a dry run that raises is logged and the preload
    still runs (what it missed compiles in the warm-up). On the CPU no Triton kernel runs,
    so nothing is recorded."""
    import kiln.llm as kl
    from kiln.runtime.kernel_record import KernelRecord

    llm = LLM("dummy:tiny", device="cpu", max_seq_len=128, max_batch_size=4, max_num_tokens=64,
              enforce_eager=True, progress=False)  # fmt: skip
    from triton import knobs

    seen = []
    hook = knobs.runtime.jit_cache_hook
    monkeypatch.setattr(kl, "dry_run", lambda *a: seen.append((a, knobs.runtime.jit_cache_hook)))
    figures = llm._dry_run(KernelRecord(None), [1, 2, 4])
    assert figures["recorded"] == 0 and figures["dry_run_s"] >= 0
    ((args, deferring),) = seen
    assert deferring is not hook and knobs.runtime.jit_cache_hook is hook  # only inside
    runner, kv, limits, vocab, eager, sizes, max_len = args
    assert runner is llm.core.runner and kv is llm.kv and sizes == [1, 2, 4] and not eager
    assert (vocab, max_len, limits) == (llm.config.vocab_size, 128, llm.engine.limits)

    def boom(*a: object) -> None:
        raise RuntimeError("stand-in failure")

    monkeypatch.setattr(kl, "dry_run", boom)
    with caplog.at_level("WARNING", logger="kiln.llm"):
        figures = llm._dry_run(KernelRecord(None), [])
    assert "dry run stopped early: stand-in failure" in caplog.text
    assert figures["recorded"] == 0 and "dry_run_s" in figures


def test_dry_run_setting() -> None:
    assert dry_run_wanted({}) is True
    assert dry_run_wanted({"KILN_LOAD_DRY_RUN": "1"}) is True
    assert dry_run_wanted({"KILN_LOAD_DRY_RUN": "0"}) is False
    with pytest.raises(ConfigError, match=r"KILN_LOAD_DRY_RUN='yes' is invalid"):
        dry_run_wanted({"KILN_LOAD_DRY_RUN": "yes"})


@pytest.mark.gpu
def test_requests_after_load_compile_nothing() -> None:
    from kiln.runtime.compiles import count_compiles

    llm = LLM("dummy:tiny", max_seq_len=512, max_batch_size=64, max_num_tokens=1024,
              progress=False)  # fmt: skip
    assert llm.kernel_warmup is not None and llm.kernel_warmup["steps"] > 0
    gen = torch.Generator().manual_seed(0)
    prompts, params = [], []
    for i in range(96):  # prompt and output lengths, greedy and sampled, spread widely
        n = int(torch.randint(1, 400, (1,), generator=gen))
        prompts.append([int(t) for t in torch.randint(5, 500, (n,), generator=gen)])
        out_len = int(torch.randint(1, 100, (1,), generator=gen))
        temp = 0.0 if i % 2 else 0.8
        params.append(SamplingParams(max_tokens=out_len, temperature=temp, ignore_eos=True))
    with count_compiles() as log:
        assert log is not None
        llm.generate(prompts, params, use_tqdm=False)
        # one sequence alone: the smallest steps
        llm.generate(prompts[:1], params[:1], use_tqdm=False)
    assert log.count == 0, log.figures()
