"""tuning.json: written by every build, made active at load; CUDA-graph batch sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.build.builder import build_engine
from kiln.build.loader import load_engine
from kiln.config import BuildConfig
from kiln.kernels import tuning
from kiln.runtime.cuda_graphs import default_batch_sizes

# the kernel cases run on the GPU where there is one (Triton takes no CPU tensors there)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_cpu_build_records_defaults_and_load_applies_tuning(tmp_path: Path) -> None:
    out = tmp_path / "eng"
    manifest = build_engine("dummy:tiny", out, BuildConfig(device="cpu"), progress=False)
    t = json.loads((out / "tuning.json").read_text())
    assert t["tuned"] is False and "CPU" in t["why"]
    assert t["kernels"] == tuning.DEFAULTS
    assert "tuning.json" in manifest["files"]  # hashed like every engine file
    # an engine tuned elsewhere: its values become active at load; unknown keys are ignored
    t["kernels"]["decode_attention"] = {"target_programs": 999, "num_warps": 8, "new_key": 1}
    t["kernels"]["kernel_from_the_future"] = {"x": 1}
    (out / "tuning.json").write_text(json.dumps(t))
    from kiln.build.engine_dir import sha256_file, write_manifest

    m = json.loads((out / "manifest.json").read_text())
    m.pop("files")
    write_manifest(out, m)
    assert (
        sha256_file(out / "tuning.json")
        == json.loads((out / "manifest.json").read_text())["files"]["tuning.json"]["sha256"]
    )
    try:
        engine = load_engine(out, "cpu")
        assert engine.tuning is not None
        # keys the file lacks (an engine tuned before they existed) keep their defaults
        assert tuning.tuned("decode_attention") == {
            "target_programs": 999,
            "num_warps": 8,
            "blocks_per_step": 1,
        }
        assert tuning.tuned("prefill_attention") == tuning.DEFAULTS["prefill_attention"]
    finally:
        tuning.set_tuning(None)
    assert tuning.tuned("decode_attention") == tuning.DEFAULTS["decode_attention"]


def test_default_cuda_graph_batch_sizes() -> None:
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    s = default_batch_sizes(512)
    assert s[:5] == [1, 2, 4, 8, 16] and s[-1] == 512
    # padding to the next size wastes at most 1/8 of a step above 16 sequences
    for b in range(17, 513):
        g = min(x for x in s if x >= b)
        assert (g - b) / b < 0.125 or g - b < 16
    assert default_batch_sizes(1000)[-2:] == [960, 1000]


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_decode_tuning_cases_run_every_candidate_shape(kv_fp8: bool) -> None:
    """The build's decode-attention cases (over an fp8 cache for fp8-KV engines) run with
    each kind of candidate the tuner times, blocks per step included; on the CPU through
    the interpreter, so that a GPU build does not first meet a broken case (a failing
    candidate would only be recorded and skipped)."""
    from kiln.build.tuning import _decode_case
    from kiln.config import ModelConfig

    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128,
    )  # fmt: skip
    case = _decode_case(cfg, torch.float32, 2, 40, 16, kv_fp8=kv_fp8, device=DEV)
    outs = [
        case({"target_programs": 8, "num_warps": 4, "blocks_per_step": nb}).clone()
        for nb in (1, 2, 4)
    ]
    assert torch.isfinite(outs[0]).all() and outs[0].abs().sum() > 0
    for o in outs[1:]:  # the step size changes the order of the sums, not the result
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)


def test_decode_case_with_the_engine_limit() -> None:
    """A case called as the CUDA graphs call the kernel (``max_seq_len`` the engine's limit,
    longer than the context) gives the same attention as one bounded by the context."""
    from kiln.build.tuning import _decode_case

    cfg = _small_config()
    c = {"target_programs": 8, "num_warps": 4, "blocks_per_step": 1}
    torch.manual_seed(0)
    short = _decode_case(cfg, torch.float32, 1, 40, 16, device=DEV)(c).clone()
    torch.manual_seed(0)
    long = _decode_case(cfg, torch.float32, 1, 40, 16, device=DEV, limit=256)(c)
    torch.testing.assert_close(long, short, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,tier", [(1, "small"), (8, "small"), (9, "medium"), (12, "medium"),
                                    (13, "main")])  # fmt: skip
def test_decode_attention_small_batch_configuration(b: int, tier: str, monkeypatch) -> None:
    """Steps of at most ``small_batch.max_batch`` sequences launch with the small-batch
    configuration's splits and warps, then up to ``medium_batch.max_batch`` with the
    medium one's, larger ones with the main configuration's (the launch grid recorded on
    the CPU); results stay right either way."""
    from kiln.kernels import decode_attention as da

    grids = []
    real = da._decode_partial

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *a, **k: grids.append(k["num_warps"]) or real[grid](*a, **k)

    monkeypatch.setattr(da, "_decode_partial", Spy())
    hk, hq, d, bs, nb = 2, 4, 16, 16, 4
    kv = torch.randn(2, b * nb, bs, hk, d, device=DEV)
    tables = torch.arange(b * nb, dtype=torch.int32, device=DEV).view(b, nb)
    lens = torch.full((b,), 50, dtype=torch.int32, device=DEV)
    q = torch.randn(b, hq, d, device=DEV)
    tok = torch.arange(b, device=DEV)
    out = torch.empty_like(q)
    tuning.set_tuning({"decode_attention": {
        "target_programs": 2 * b * hk, "num_warps": 4, "blocks_per_step": 1,
        "small_batch": {"max_batch": 8, "target_programs": 4 * b * hk, "num_warps": 2,
                        "blocks_per_step": 1},
        "medium_batch": {"max_batch": 12, "target_programs": 1 * b * hk, "num_warps": 8,
                         "blocks_per_step": 1},
    }})  # fmt: skip
    try:
        da.decode_attention_triton(q, kv, tables, lens, tok, out, d**-0.5, 64)
    finally:
        tuning.set_tuning(None)
    (grid, warps) = grids
    want = {"small": (4, 2), "medium": (1, 8), "main": (2, 4)}[tier]
    assert grid[:2] == (b, hk) and (grid[2], warps) == want
    ref = torch.empty_like(q)
    da.decode_attention_triton(q, kv, tables, lens, tok, ref, d**-0.5, 64,
                               num_splits=1)  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_batch,max_seq", [(256, 4096), (4, 1024)])
def test_tune_adds_the_small_batch_decode_configuration(max_batch: int, max_seq: int,
                                                        monkeypatch) -> None:  # fmt: skip
    """A GPU build tunes decode attention over the main tier's cases (single-call timing),
    and apart over ``SMALL_BATCH_CASES`` (one block a step only) then
    ``MEDIUM_BATCH_CASES``, called with the engine's limit as ``max_seq_len`` and timed in
    CUDA graphs; those picks are recorded
    as the configuration's ``small_batch`` (steps of up to 8 sequences, fewer if the
    engine allows fewer) and ``medium_batch`` (up to 64; none where the engine takes at
    most 8). The timing itself is replaced by a recorder here (CPU)."""
    from kiln.build import tuning as tn
    from kiln.build import tuning_cases as tc
    from kiln.checkpoint.dummy import DummyCheckpoint

    made, best_calls, steps = [], [], []

    def case(cfg, dtype, b, ctx, bs, kv_fp8=False, device="cuda", limit=None):
        made.append((b, ctx, limit))
        return lambda c: None

    def best(name, candidates, cases, timer=tn._median_ms):
        best_calls.append((name, len(cases), timer))
        [c.make() for c in cases if isinstance(c, tn.Lazy)]  # the main tier's, made late
        if name == "decode_attention":
            steps.append({c["blocks_per_step"] for c in candidates})
        if name != "decode_attention":
            return {}, []
        tp = 528 if timer is tn._graph_ms else 1056
        return {"target_programs": tp, "num_warps": 4, "blocks_per_step": 1}, []

    monkeypatch.setattr(tn, "_decode_case", case)
    monkeypatch.setattr(tn, "_prefill_case", lambda *a, **k: None)
    monkeypatch.setattr(tn, "_case_budget", lambda: tc.CASE_CACHE_BYTES)  # no GPU here
    monkeypatch.setattr(tn, "_best", best)
    monkeypatch.setattr(tn, "_tune_skinny", lambda cfg, dtype, shapes: ({}, {}))
    monkeypatch.setattr(tn, "_tune_weight_only", lambda cfg, quant: ({}, {}))
    monkeypatch.setattr(tn, "prefill_config_candidates", lambda d, dtype: [])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    cfg = DummyCheckpoint.from_source("dummy:tiny").config
    limits = {"max_seq_len": max_seq, "max_batch_size": max_batch, "max_num_tokens": 2048}
    out = tn.tune(cfg, torch.bfloat16, "cuda", limits)
    small, medium = min(8, max_batch), min(64, max_batch)
    tiers = {"small_batch": {"max_batch": small, "target_programs": 528, "num_warps": 4,
                             "blocks_per_step": 1}}  # fmt: skip
    if medium > small:  # an engine of at most 8 sequences has no medium tier
        tiers["medium_batch"] = tiers["small_batch"] | {"max_batch": medium}
    assert out["kernels"]["decode_attention"] == {
        "target_programs": 1056,
        "num_warps": 4,
        "blocks_per_step": 1,
        **tiers,
    }
    n_small = len(tn.SMALL_BATCH_CASES)
    want = [(min(b, small), min(c, max_seq), max_seq) for b, c in tn.SMALL_BATCH_CASES]
    if medium > small:
        want += [(min(b, medium), min(c, max_seq), max_seq) for b, c in tn.MEDIUM_BATCH_CASES]
    assert made[len(tc.DECODE_CASES) :] == want
    # the main tier's cases in its range, within the limits, called with the engine's limit
    main = [(min(b, max_batch), min(c, max_seq), max_seq) for b, c in tc.DECODE_CASES]
    assert made[: len(main)] == main
    decode = [(n, t) for name, n, t in best_calls if name == "decode_attention"]
    graphs = [(n_small, tn._graph_ms)] + [(len(tn.MEDIUM_BATCH_CASES), tn._graph_ms)] * (
        medium > small)  # fmt: skip
    assert decode == [(len(tc.DECODE_CASES), tn._median_ms), *graphs]
    # the small-batch tier picks among one block a step only (its graph-timed cases
    # favoured 4, which ran slower in the engine); the others among 1, 2 and 4
    assert steps == [{1, 2, 4}, {1}, *[{1, 2, 4}] * (medium > small)]
    # where the build's time went, per kernel tuned (seconds, all of them, in order)
    phases = out["measured"]["phase_s"]
    assert list(phases) == ["decode_attention", "prefill_attention", "skinny_matmul",
                            "weight_only", "fp8_skinny"]  # fmt: skip
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) <= out["wall_time_s"] + 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_small_batch_decode_tuning_on_gpu() -> None:
    """The graph-timed small- and medium-batch cases, and the main tier's lazily made
    ones, run on the GPU for every candidate kind (a failure would only be recorded and
    the defaults kept)."""
    from kiln.build import tuning as tn
    from kiln.checkpoint.dummy import DummyCheckpoint

    cfg = DummyCheckpoint.from_source("dummy:tiny").config
    cases = [tn._decode_case(cfg, torch.bfloat16, b, min(c, 1024), 32, limit=1024)
             for b, c in (*tn.SMALL_BATCH_CASES, *tn.MEDIUM_BATCH_CASES)]  # fmt: skip
    cands = [{"target_programs": p, "num_warps": w, "blocks_per_step": n}
             for p, w, n in ((264, 4, 1), (528, 8, 2), (1056, 4, 4))]  # fmt: skip
    best, rows = tn._best("decode_attention", cands, cases, tn._graph_ms)
    assert all("ms" in r and 0 < r["ms"] < 10 for r in rows), rows
    assert best == {k: min(rows, key=lambda r: r["ms"])[k] for k in best}
    # the main tier's cases, made one at a time, single calls, over an fp8 cache
    limits = {"max_batch_size": 2048, "max_seq_len": 4096}
    lazy = [tn.Lazy(lambda b=b, c=c: tn._decode_case(cfg, torch.bfloat16, b, c, 32, True,
                                                     limit=4096))
            for b, c in tn.main_decode_cases(cfg, torch.bfloat16, limits, True)]  # fmt: skip
    best, rows = tn._best("decode_attention", cands, lazy)
    assert all("ms" in r and 0 < r["ms"] < 100 for r in rows), rows
    assert best == {k: min(rows, key=lambda r: r["ms"])[k] for k in best}


def test_decode_case_splits_as_the_engine_derives_them(monkeypatch) -> None:
    """With the engine's limit a case passes the launcher's own split count (a power of
    two, ``default_splits``) and the limit as ``max_seq_len``; without, the throughput
    cases' plain quotient and the context (recorded, not run)."""
    from kiln.build.tuning import _decode_case
    from kiln.kernels import decode_attention as da

    calls = []
    monkeypatch.setattr(da, "decode_attention_triton", lambda *a, **k: calls.append((a, k)))
    cfg = _small_config()
    c = {"target_programs": 12, "num_warps": 4, "blocks_per_step": 1}
    _decode_case(cfg, torch.float32, 1, 40, 16, device="cpu", limit=256)(c)
    _decode_case(cfg, torch.float32, 1, 40, 16, device="cpu")(c)
    (a1, k1), (a0, k0) = calls
    assert (a1[7], k1["num_splits"]) == (256, 8) and da.default_splits(12, 1, 2) == 8
    assert (a0[7], k0["num_splits"]) == (40, 6)


def _small_config():  # a small model's config for the decode cases
    from kiln.config import ModelConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256,
    )  # fmt: skip


@pytest.mark.parametrize("head", [False, True])
def test_weight_only_tuning_shapes_and_rows(head: bool, monkeypatch) -> None:
    """An int4-awq build tunes each projection shape at every row count of ``WQ_TUNE_ROWS``
    (1-64), and the lm_head's shape too where it is quantized, on one set of random weights
    per shape (made once for all its row counts); each shape's picks land under its key
    (recorded on the CPU: no kernel is timed)."""
    from kiln.bench import quant_bench
    from kiln.build import tuning as tn
    from kiln.config import ModelConfig, QuantConfig

    calls, made = [], []

    def fake(n, k, m, group, ws):
        assert ws == [("weights", n, k, group)]  # the shape's one set
        calls.append((n, k, m))
        return [{"config": {"BLOCK_N": n % 7 + m}, "ms": 1.0}]

    def copies(n, k, group):
        made.append((n, k))
        return [("weights", n, k, group)]

    monkeypatch.setattr(quant_bench, "tune_weight_only", fake)
    monkeypatch.setattr(quant_bench, "weight_only_copies", copies)
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=384, hidden_size=256, intermediate_size=512,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=128,
    )  # fmt: skip
    quant = QuantConfig(algo="int4-awq", group_size=128, quantize_lm_head=head)
    picks, _ = tn._tune_weight_only(cfg, quant)
    qkv = (256 + 2 * 128, 256)  # q 4 x 64, k and v 2 x 64 each
    shapes = {qkv, (256, 256), (1024, 256), (256, 512)} | ({(384, 256)} if head else set())
    want = {(n, k, m) for n, k in shapes for m in tn.WQ_TUNE_ROWS}
    assert set(calls) == want and len(calls) == len(want)
    assert sorted(made) == sorted(shapes)  # once per shape
    assert tn.WQ_TUNE_ROWS == (1, 4, 8, 16, 32, 64)
    key = "int4g128:384x256"
    assert (key in picks["by_shape"]) == head
    if head:
        assert picks["by_shape"][key]["64"] == {"BLOCK_N": 384 % 7 + 64}


def test_weight_only_tuning_precompiles_every_shape_first(monkeypatch) -> None:
    """On a GPU (stood in for), every shape's candidates are first called untimed at every
    row count (on one weight copy) inside one ``kernel_record.precompile`` (their new
    variants then compile at once in threads), then timed as before; with
    ``KILN_COMPILE_WORKERS=0`` there is no dry run."""
    from kiln.bench import quant_bench
    from kiln.build import tuning as tn
    from kiln.config import ModelConfig, QuantConfig
    from kiln.runtime import kernel_record

    calls = []

    def fake(n, k, m, group, ws, timed=True):
        calls.append((n, k, m, timed, len(ws)))
        return [{"config": {"BLOCK_N": m}, "ms": 1.0}] if timed else [{"config": {}}]

    def fake_pre(work, workers=None):
        work()
        return {"compiled": 7}

    monkeypatch.setattr(quant_bench, "tune_weight_only", fake)
    monkeypatch.setattr(quant_bench, "weight_only_copies",
                        lambda n, k, g, empty=False: ["w1", "w2"][: 1 if empty else 2])  # fmt: skip
    monkeypatch.setattr(kernel_record, "precompile", fake_pre)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=384, hidden_size=256, intermediate_size=512,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=128,
    )  # fmt: skip
    quant = QuantConfig(algo="int4-awq", group_size=128)
    monkeypatch.setenv("KILN_COMPILE_WORKERS", "4")
    picks, measured = tn._tune_weight_only(cfg, quant)
    rows = tn.WQ_TUNE_ROWS
    shapes = sorted({(512, 256), (256, 256), (1024, 256), (256, 512)})
    # every shape's dry run (one weight copy) in one precompile, then the timed runs
    want = [(n, k, m, False, 1) for n, k in shapes for m in rows]
    want += [(n, k, m, True, 2) for n, k in shapes for m in rows]
    assert calls == want
    assert measured["precompile"] == {"compiled": 7}
    assert picks["by_shape"]["int4g128:256x256"]["64"] == {"BLOCK_N": 64}
    calls.clear()
    monkeypatch.setenv("KILN_COMPILE_WORKERS", "0")
    _, measured = tn._tune_weight_only(cfg, quant)
    assert "precompile" not in measured and all(c[3] for c in calls)


@pytest.mark.parametrize("group", [128, 64, None])
def test_weight_only_dry_run_weights_are_shaped_and_typed_like_real_ones(
    group, monkeypatch
) -> None:
    """The dry run's uninitialized weights (no random N x K copy to quantize: the lm_head
    is half a billion codes) have every tensor's shape and dtype of a real quantized set,
    so the dry run compiles the variants the timing will launch."""
    from kiln.bench import quant_bench

    monkeypatch.setattr(quant_bench, "DEV", "cpu")
    real = quant_bench._wq_weights(300, 256, group is not None, group or 0, 1)[0]
    dry = quant_bench.weight_only_copies(300, 256, group, empty=True)
    assert len(dry) == 1
    for r, d in zip(real, dry[0], strict=True):
        assert (r is None) == (d is None)
        if r is not None:
            assert (d.shape, d.dtype, d.device) == (r.shape, r.dtype, r.device)


def test_weight_only_dry_run_calls_each_launch_once_without_reference(monkeypatch) -> None:
    """``tune_weight_only(timed=False)`` (the precompile's dry run, whose launches are
    deferred) calls each distinct launch once, in order, and computes no float32 reference
    (for the lm_head that is a dequantized copy of the whole weight); nothing is timed."""
    from kiln.bench import quant_bench
    from kiln.kernels import wq_gemm

    launched = []

    def no_ref(*a, **k):
        raise AssertionError("the dry run computed the reference")

    def no_timing(*a, **k):
        raise AssertionError("the dry run timed a candidate")

    def fake_launch(x, p, s, z, smooth, bias, cfg):
        launched.append(cfg)
        return torch.full((x.shape[0], p.shape[0]), float("nan"))  # deferred: garbage

    monkeypatch.setattr(quant_bench, "DEV", "cpu")
    monkeypatch.setattr(wq_gemm, "wq_linear_ref", no_ref)
    monkeypatch.setattr(wq_gemm, "wq_linear_triton", fake_launch)
    monkeypatch.setattr(quant_bench.wq_f16, "ENABLED", True)  # the default
    monkeypatch.setattr(quant_bench.wq_f16, "wq4_f16", lambda a, p, s, z, cfg: fake_launch(
        torch.empty(a.shape), p, s, z, None, None, cfg))  # fmt: skip
    monkeypatch.setattr(quant_bench, "time_per_call_ms", no_timing)
    ws = [(torch.zeros(64, 128, dtype=torch.uint8), torch.ones(64, 2), torch.zeros(64, 2))]
    for m in (1, 8):
        launched.clear()
        rows = quant_bench.tune_weight_only(64, 256, m, 128, ws=ws, timed=False)
        assert rows and [r["config"] for r in rows] == launched
        assert any(c.get("F16") for c in launched)  # the float16-code kernel's too
        assert all("ms" not in r and "error" not in r for r in rows)
        keys = [tuple(sorted(c.items())) for c in launched]
        assert len(keys) == len(set(keys))


def test_precompile_dry_run_calls_every_candidate_on_every_case(monkeypatch) -> None:
    """``_each_once``'s dry run calls each part's candidates once on each of its cases (a
    ``Lazy`` case made once, failures swallowed: the timed run records them); off without a
    GPU or with ``KILN_COMPILE_WORKERS=0``."""
    from kiln.build import tuning as tn
    from kiln.runtime import kernel_record

    calls, made = [], []

    def case(tag):
        def run(c):
            calls.append((tag, c["v"]))
            if c["v"] == 2:
                raise RuntimeError("too much shared memory")

        return run

    def lazy(tag):
        made.append(tag)
        return case(tag)

    parts = [([{"v": 1}, {"v": 2}], [case("a"), tn.Lazy(lambda: lazy("b"))]),
             ([{"v": 3}], [case("c")])]  # fmt: skip
    monkeypatch.setattr(kernel_record, "precompile", lambda work: work() or {"compiled": 5})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tn._precompile(tn._each_once(parts)) is None and calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("KILN_COMPILE_WORKERS", "0")
    assert tn._precompile(tn._each_once(parts)) is None and calls == []
    monkeypatch.setenv("KILN_COMPILE_WORKERS", "3")
    assert tn._precompile(tn._each_once(parts)) == {"compiled": 5}
    assert calls == [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("c", 3)] and made == ["b"]


def test_main_decode_cases_fit_the_limits_and_the_cache_budget() -> None:
    """The main tier's cases are cut to the engine's sequences and length, and to at most
    ``CASE_CACHE_BYTES`` of K and V each (fp8: one byte a value, else the dtype's)."""
    from kiln.build import tuning_cases as tc
    from kiln.checkpoint.dummy import DummyCheckpoint

    cfg = DummyCheckpoint.from_source("dummy:llama-3.1-8b").config
    big = {"max_batch_size": 4096, "max_seq_len": 8192}
    assert tc.main_decode_cases(cfg, torch.bfloat16, big, True) == list(tc.DECODE_CASES)
    small = {"max_batch_size": 300, "max_seq_len": 512}
    assert tc.main_decode_cases(cfg, torch.bfloat16, small, True) == [
        (96, 512), (256, 512), (300, 512), (300, 256)]  # fmt: skip
    token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # bf16 K and V
    for b, c in tc.main_decode_cases(cfg, torch.bfloat16, big, False):
        assert b * c * token <= tc.CASE_CACHE_BYTES
    assert tc.main_decode_cases(cfg, torch.bfloat16, big, False)[2] == (
        tc.CASE_CACHE_BYTES // (token * 1536), 1536)  # fmt: skip
    # a GPU with little memory free: a smaller budget cuts the sequences, never below one
    tight = tc.main_decode_cases(cfg, torch.bfloat16, big, True, budget=token * 2048)
    assert tight == [(2, 2048), (4, 1024), (2, 1536), (16, 256)]
    assert tc.main_decode_cases(cfg, torch.bfloat16, big, True, budget=1)[0] == (1, 2048)


def test_best_makes_lazy_cases_one_at_a_time() -> None:
    """``_best`` makes a ``Lazy`` case only when it times it, after every candidate has
    run on the case before; a candidate that fails is recorded and not run again; the
    pick is the least total."""
    from kiln.build import tuning as tn

    log = []

    def make(k):
        log.append(("make", k))
        return lambda c: log.append(("run", k, c["target_programs"]))

    def timer(fn):
        fn()
        c = log[-1][2]
        if c == 3:
            raise RuntimeError("out of shared memory")
        return {1: 2.0, 2: 1.0}[c]

    cands = [{"target_programs": v, "num_warps": 4, "blocks_per_step": 1} for v in (1, 2, 3)]
    cases = [tn.Lazy(lambda: make(0)), tn.Lazy(lambda: make(1))]
    best, rows = tn._best("decode_attention", cands, cases, timer)
    assert log == [("make", 0), ("run", 0, 1), ("run", 0, 2), ("run", 0, 3),
                   ("make", 1), ("run", 1, 1), ("run", 1, 2)]  # fmt: skip
    assert [r.get("ms") for r in rows] == [4.0, 2.0, None]
    assert rows[2]["error"].startswith("RuntimeError: out of shared memory")
    assert best == cands[1]
