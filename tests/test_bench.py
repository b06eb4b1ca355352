"""``kiln bench``: datasets, metrics and the roofline model on their own; the throughput,
latency and ceilings commands on the tiny preset and the embedded SmolLM2 (with the HF
peer); the serve benchmark against a real ``kiln serve`` process."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kiln.bench import ceilings, datasets, metrics, roofline
from kiln.bench.report import markdown_row
from kiln.checkpoint.dummy import PRESETS
from kiln.cli import main
from kiln.config import ModelConfig
from kiln.runtime.stats import StepRecord

TINY = ModelConfig(**PRESETS["tiny"])


# ---- datasets, metrics, roofline (no engine) -------------------------------------------


def test_synthetic_dataset_is_seeded_and_round_trips(tmp_path: Path) -> None:
    a = datasets.synthetic(20, 32, 16, 512, seed=3)
    assert a == datasets.synthetic(20, 32, 16, 512, seed=3)
    assert a != datasets.synthetic(20, 32, 16, 512, seed=4)
    assert all(r.input_tokens == 32 and r.output_tokens == 16 for r in a)
    assert all(0 <= t < 512 for r in a for t in r.input_ids or ())
    b = datasets.synthetic(400, 64, 32, 1000, isl_stdev=8, osl_stdev=4, seed=1, max_len=128)
    ins = [r.input_tokens for r in b]
    outs = [r.output_tokens for r in b]
    assert abs(np.mean(ins) - 64) < 2 and 5 < np.std(ins) < 11
    assert abs(np.mean(outs) - 32) < 1.5 and 2 < np.std(outs) < 6
    assert all(r.input_tokens + r.output_tokens <= 128 and r.output_tokens >= 1 for r in b)
    path = tmp_path / "d.jsonl"
    datasets.save_jsonl(b, path)
    assert datasets.load_jsonl(path) == b
    assert json.loads(path.read_text().splitlines()[0]).keys() == {
        "task_id",
        "input_ids",
        "output_tokens",
    }


def test_text_file_dataset(tmp_path: Path) -> None:
    f = tmp_path / "prompts.txt"
    f.write_text("one two three\n\n  four five \n")
    reqs = datasets.from_text_file(f, 8, lambda s: len(s.split()), num_requests=5)
    assert [r.prompt for r in reqs] == ["one two three", "four five"] * 2 + ["one two three"]
    assert [r.input_tokens for r in reqs] == [3, 2, 3, 2, 3]
    datasets.save_jsonl(reqs, tmp_path / "t.jsonl")
    assert datasets.load_jsonl(tmp_path / "t.jsonl") == reqs


def test_percentiles_match_numpy_and_are_ordered() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        s = metrics.summarize(xs)
        for q in metrics.PERCENTILES:
            assert s[f"p{q}"] == pytest.approx(float(np.percentile(xs, q)))
        assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert math.isnan(metrics.summarize([])["p50"])


def test_request_timing_figures() -> None:
    t = metrics.RequestTiming(10, 4, 4, submitted=1.0, token_times=[1.5, 1.6, 1.8, 2.1])
    assert t.ttft == pytest.approx(0.5) and t.e2e == pytest.approx(1.1)
    assert t.tpot == pytest.approx(0.2) and t.itls == pytest.approx([0.1, 0.2, 0.3])
    f = metrics.aggregate([t, t], wall_time_s=2.0)
    assert f["output_tokens"] == 8 and f["output_tokens_per_s"] == 4.0
    assert f["total_tokens_per_s"] == 14.0 and f["request_throughput"] == 1.0
    assert f["output_tokens_per_s_per_user"] == pytest.approx(5.0)
    assert f["tpot_ms"]["p50"] == pytest.approx(200.0)


def test_roofline_counts_bytes_and_flops_by_hand() -> None:
    cfg = TINY  # untied: embedding rows gathered, lm_head read whole
    h, v, L, i = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.intermediate_size
    layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i + 2 * h
    # a prefill of 5 tokens (sequence A) and a decode at position 9 (sequence B)
    rec = StepRecord(0.0, 1.0, 2, 5, 1, context_tokens=5 + 10, attention_pairs=15 + 10)
    kv_tok = 2 * L * cfg.kv_size * 4
    c = roofline.ModelCosts.of(cfg, 4)
    weights = (L * layer + h + v * h) * 4  # layers, final norm, lm_head
    assert c.step_bytes(rec) == weights + 6 * h * 4 + (15 + 6) * kv_tok
    flops = 2 * L * layer * 6 + 2 * v * h * 2 + 4 * 25 * cfg.num_attention_heads * cfg.head_dim * L
    assert c.step_flops(rec) == flops
    r = roofline.roofline(cfg, [rec], 4, 1e9, 1e12)
    assert r["ideal_time_s"] == pytest.approx(max(c.step_bytes(rec) / 1e9, flops / 1e12))
    assert r["fraction"] == pytest.approx(r["ideal_time_s"] / 1.0)
    # quantized: the engine's weight bytes, 1-byte KV elements, layer FLOPs at twice the rate
    q = roofline.QuantCosts(weight_bytes=1000, kv_itemsize=1, layer_rate_factor=2.0)
    rq = roofline.roofline(cfg, [rec], 4, 1e9, 1e12, q)
    qbytes = 1000 + 6 * h * 4 + (15 + 6) * kv_tok // 4
    layer_flops = 2 * L * layer * 6
    assert rq["bytes"] == qbytes and rq["flops"] == flops
    want = max(qbytes / 1e9, (flops - layer_flops / 2) / 1e12)
    assert rq["ideal_time_s"] == pytest.approx(want)


def test_ceilings_are_measured_once_and_cached() -> None:
    dev = torch.device("cpu")
    first = ceilings.get(dev, quick=True)
    again = ceilings.get(dev)
    assert again["cached"] == str(ceilings.cache_path(dev))
    assert again["copy_bandwidth_bytes_per_s"] == first["copy_bandwidth_bytes_per_s"] > 1e8
    rates = again["matmul_flops_per_s"]
    assert rates["float32"] > 1e8 and rates["bfloat16"] > 0
    assert ceilings.rate_for(again, torch.float32) == rates["float32"]
    assert ceilings.rate_for(again, torch.float16) == rates["float32"]  # not measured on CPU


# ---- commands on the tiny preset ----------------------------------------------------------


def _report(path: Path) -> dict[str, Any]:
    r = json.loads(path.read_text())
    for key in ("commit", "date", "device", "versions", "settings", "figures"):
        assert r[key], key
    assert r["versions"]["torch"] == torch.__version__
    return r


def _check_run(f: dict[str, Any], n: int, osl: int) -> None:
    assert f["num_requests"] == f["num_completed"] == n and f["num_failed"] == 0
    assert f["output_tokens"] == f["requested_output_tokens"] == n * osl
    assert f["tokens_match"] is True
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = f[key]
        assert 0 <= s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
    assert f["ttft_ms"]["p50"] <= f["e2e_ms"]["p50"]
    assert f["output_tokens_per_s"] == pytest.approx(f["output_tokens"] / f["wall_time_s"])


TINY_ARGS = ["--model", "dummy:tiny", "--isl", "24", "--osl", "12", "--no-progress"]


def test_throughput_tiny_with_hf_peer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", *TINY_ARGS, "--num-requests", "24", "--report-json", str(out)]
    assert main([*argv, "--peer", "hf", "--peer-batch-size", "8"]) == 0
    r = _report(out)
    f = r["figures"]
    _check_run(f, 24, 12)
    assert 0.0 < f["roofline"]["fraction"] <= 1.0
    assert f["roofline"]["steps"] == f["engine_steps"] >= 12
    assert 0 < f["peak_kv_cache_usage"] <= 1 and f["num_preemptions"] == 0
    # the CPU engine runs torch kernels: no Triton variant is loaded while measuring
    assert f["triton_variants_loaded"] == {"count": 0, "seconds": 0.0, "by_kernel": {}}
    s = r["settings"]
    assert s["model"] == "dummy:tiny" and s["dtype"] == "float32"
    assert s["dataset"]["num_requests"] == 24 and s["ceilings"]["copy_bandwidth_bytes_per_s"] > 0
    peer = r["peer"]["figures"]
    assert peer["batch_size"] == 8 and peer["num_batches"] == 3
    assert peer["output_tokens"] == peer["generated_tokens"] == 24 * 12
    ratio = r["peer"]["ratios"]["output_tokens_per_s"]
    assert ratio == pytest.approx(f["output_tokens_per_s"] / peer["output_tokens_per_s"])
    stdout = capsys.readouterr().out
    assert "% of roofline" in stdout and "kiln/peer" in stdout
    row = stdout.strip().splitlines()[-1]
    assert row == markdown_row(r, out) and row.count(" | ") == 4
    assert f"{ratio:.2f}x HF" in row


def test_throughput_capped_concurrency_and_saved_dataset(tmp_path: Path) -> None:
    data, out = tmp_path / "d.jsonl", tmp_path / "t.json"
    argv = ["bench", "throughput", *TINY_ARGS, "--num-requests", "10", "--osl-stdev", "3"]
    argv += ["--concurrency", "3", "--save-dataset", str(data), "--report-json", str(out)]
    assert main(argv) == 0
    reqs = datasets.load_jsonl(data)
    f = _report(out)["figures"]
    assert len({r.output_tokens for r in reqs}) > 1  # normally distributed lengths
    total = sum(r.output_tokens for r in reqs)
    assert f["output_tokens"] == f["requested_output_tokens"] == total and f["tokens_match"]
    assert f["max_seqs_per_step"] == 3  # the cap holds, and is reached
    assert f["engine_steps"] >= math.ceil(total / 3)
    # the saved dataset runs again, unchanged, from the file
    out2 = tmp_path / "t2.json"
    assert main(["bench", "throughput", *TINY_ARGS, "--dataset", str(data), "--report-json",
                 str(out2)]) == 0  # fmt: skip
    assert _report(out2)["figures"]["output_tokens"] == f["output_tokens"]


def test_latency_tiny(tmp_path: Path) -> None:
    out = tmp_path / "l.json"
    argv = ["bench", "latency", *TINY_ARGS, "--batch-sizes", "1-2,4", "--iterations", "2"]
    assert main([*argv, "--report-json", str(out)]) == 0
    rows = _report(out)["figures"]["batch_sizes"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    for r in rows:
        _check_run(r, 2 * r["batch_size"], 12)
        assert r["tpot_ms"]["p50"] > 0


def test_bench_refuses_requests_longer_than_the_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "throughput", *TINY_ARGS, "--max-seq-len", "16", "--num-requests", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kiln bench throughput: error: ") and "max_seq_len" in err


def test_bench_kv_cache_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", *TINY_ARGS, "--num-requests", "2", "--kv-cache-dtype", "fp8",
            "--kv-cache-free-gpu-memory-fraction", "0.5", "--report-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    s = _report(out)["settings"]
    assert s["kv_cache_dtype"] == "fp8" and s["memory_plan"]["free_gpu_memory_fraction"] == 0.5
    assert _report(out)["figures"]["tokens_match"]
    for bad in ("0.0", "1.5", "-0.1"):
        argv = ["bench", "latency", *TINY_ARGS, "--kv-cache-free-gpu-memory-fraction", bad]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"--kv-cache-free-gpu-memory-fraction={bad} is invalid: a number in (0, 1]" in err


# ---- SmolLM2 --------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_throughput_text_prompts_and_hf_peer(smollm2_llm, tmp_path: Path) -> None:
    """The embedded model through the API: a text-prompt dataset (token counts from its
    tokenizer), then a synthetic one against the transformers peer read from the GGUF."""
    from kiln.bench import peer, throughput

    f = tmp_path / "p.txt"
    f.write_text("The capital of France is\nWhy is the sky blue?\n")
    reqs = datasets.from_text_file(f, 4, lambda s: len(smollm2_llm.tokenizer.encode(s)))
    cpu = ceilings.get(torch.device("cpu"))
    fig = throughput.figures(
        smollm2_llm, throughput.run_requests(smollm2_llm, reqs, progress=False), cpu
    )
    _check_run(fig, 2, 4)
    assert fig["input_tokens"] == sum(r.input_tokens for r in reqs) > 6
    assert 0.0 < fig["roofline"]["fraction"] <= 1.0

    syn = datasets.synthetic(2, 8, 4, smollm2_llm.config.vocab_size, seed=7)
    kiln_fig = throughput.figures(
        smollm2_llm, throughput.run_requests(smollm2_llm, syn, progress=False), cpu
    )
    _check_run(kiln_fig, 2, 4)
    e = smollm2_llm.engine
    model = peer.load_peer(e.manifest["source"], smollm2_llm.config, e.device, e.dtype)
    pf = peer.run_peer(model, syn, 2, e.device, progress=False)
    assert pf["output_tokens"] == pf["generated_tokens"] == 8 and pf["num_batches"] == 1
    ratio = peer.ratios(kiln_fig, pf)["output_tokens_per_s"]
    assert ratio == pytest.approx(kiln_fig["output_tokens_per_s"] / pf["output_tokens_per_s"])
    assert ratio > 0


# ---- serve ----------------------------------------------------------------------------------


def test_serve_sweep_against_kiln_serve(serve_logs: Path, tmp_path: Path) -> None:
    """A real ``kiln serve`` subprocess; two request rates of 8 streamed requests each."""
    from tests.serve_util import Server

    srv = Server(
        ["--model", "dummy:tiny", "--kv-cache-max-tokens", "4096"], serve_logs, name="bench"
    )
    try:
        srv.wait_ready()
        out, plot = tmp_path / "s.json", tmp_path / "s.png"
        argv = ["bench", "serve", "--url", srv.url, "--request-rate", "20,inf", "--num-requests"]
        argv += ["8", "--isl", "16", "--osl", "8", "--plot", str(plot), "--report-json", str(out)]
        assert main([*argv, "--no-progress"]) == 0
    finally:
        assert srv.stop() == 0, srv.tail()
    r = _report(out)
    assert r["settings"]["model"] == "dummy:tiny" and r["settings"]["length_forced"] is True
    rates = r["figures"]["rates"]
    assert [x["request_rate"] for x in rates] == [20.0, "inf"]
    for x in rates:
        _check_run(x, 8, 8)
        assert x["errors"] == []
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_throughput_report_names_the_quantization(tmp_path: Path) -> None:
    """A quantized engine's report says so (settings and the markdown row), and its
    roofline counts the bytes the engine really holds and an fp8 KV cache's 1-byte
    elements."""
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", *TINY_ARGS, "--num-requests", "4", "--report-json", str(out)]
    engine = tmp_path / "e"
    assert main(["build", "--model", "dummy:tiny", "--output", str(engine), "--quant", "fp8",
                 "--kv-cache-dtype", "fp8"]) == 0  # fmt: skip
    argv[argv.index("dummy:tiny")] = str(engine)
    assert main(argv) == 0
    r = _report(out)
    assert r["settings"]["quant"] == "fp8 + fp8 KV"
    # the memory plan: on the CPU nothing is measured, and the fp8 cache holds 1-byte
    # elements for every token of its blocks and the null block
    plan, s = r["settings"]["memory_plan"], r["settings"]
    assert plan["free_bytes_at_kv_sizing"] == 0 and plan["activation_peak_bytes"] == 0
    assert plan["torch_reserved_bytes_at_kv_sizing"] == 0
    assert plan["torch_allocated_bytes_at_kv_sizing"] == 0
    from kiln.checkpoint.dummy import DummyCheckpoint

    cfg = DummyCheckpoint.from_source("dummy:tiny").config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    assert plan["kv_cache_bytes"] == (s["kv_cache_tokens"] + s["tokens_per_block"]) * per_token
    from kiln.bench.cli import _throughput_lines

    assert not any(line.startswith("memory plan") for line in _throughput_lines(r))
    plan |= {"free_bytes_at_kv_sizing": 70 * 2**30, "activation_peak_bytes": 3 * 2**29}
    lines = [line for line in _throughput_lines(r) if line.startswith("memory plan")]
    assert lines == [
        "memory plan  70.00 GiB free at sizing, 1.50 GiB step peak held back, "
        f"{plan['kv_cache_bytes'] / 2**30:.2f} GiB KV cache"
    ]
    q = r["figures"]["roofline"]["quantization"]
    assert q["label"] == "fp8 + fp8 KV" and q["kv_itemsize"] == 1
    fp32_bytes = (
        cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    ) * 4
    assert 0 < q["weight_bytes"] < fp32_bytes  # fp8 projections: fewer bytes than float32
    assert q["layer_rate_factor"] >= 1.0
    assert "(fp8 + fp8 KV)" in markdown_row(r, out)


def test_no_kernel_warmup_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--no-kernel-warmup`` loads the engine with ``kernel_warmup=False`` (the warm-up
    itself runs on CUDA only; tests/test_warmup.py); without it the warm-up is asked for."""
    import kiln.llm

    seen: list[bool] = []
    real = kiln.llm.LLM.__init__

    def spy(self, *args, **kw):
        seen.append(kw["kernel_warmup"])
        real(self, *args, **kw)

    monkeypatch.setattr(kiln.llm.LLM, "__init__", spy)
    argv = ["bench", "latency", *TINY_ARGS, "--batch-sizes", "1", "--iterations", "1"]
    assert main([*argv, "--no-kernel-warmup"]) == 0 and main(argv) == 0
    assert seen == [False, True]


# ---- --cases: several shapes on one load -----------------------------------------------


def test_throughput_cases_share_one_load_and_never_hit_an_earlier_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three cases on one engine: one load, one report each (the path's {case} replaced),
    each case's concurrency cap held. The third repeats the first's prompts (same shape and
    seed), so without the prefix cache emptied between cases it would reuse their blocks."""
    import kiln.llm

    loads: list[Any] = []
    real = kiln.llm.LLM.__init__

    def spy(self, *args, **kw):
        real(self, *args, **kw)
        loads.append(self)

    monkeypatch.setattr(kiln.llm.LLM, "__init__", spy)
    template = str(tmp_path / "t-{case}.json")
    argv = ["bench", "throughput", "--model", "dummy:tiny", "--no-progress", "--warmup", "1",
            "--cases", "6x40x12, 4x20x8@2,6x40x12@3", "--report-json", template]  # fmt: skip
    assert main(argv) == 0
    assert len(loads) == 1
    names = ["40-12-6", "20-8-4-c2", "40-12-6-c3"]
    reports = [_report(tmp_path / f"t-{n}.json") for n in names]
    for r, (n, osl, cap) in zip(reports, [(6, 12, None), (4, 8, 2), (6, 12, 3)], strict=True):
        f, s = r["figures"], r["settings"]
        _check_run(f, n, osl)
        assert s["concurrency"] == cap and s["warmup_requests"] == 1
        assert f["max_seqs_per_step"] == (cap or n)
        # this case's steps and its warm-up's four (one request of 4 output tokens), not
        # the earlier cases'
        assert s["graph_steps"] + s["eager_steps"] == f["engine_steps"] + 4
        assert s["case"]["of"] == "6x40x12, 4x20x8@2,6x40x12@3"
    assert [r["settings"]["case"]["spec"] for r in reports] == ["6x40x12", "4x20x8@2", "6x40x12@3"]
    assert [r["settings"]["case"]["index"] for r in reports] == [0, 1, 2]
    assert reports[1]["settings"]["dataset"]["num_requests"] == 4
    llm = loads[0]
    assert llm.core.blocks.tokens_per_block < 40  # the prompts fill whole blocks
    assert llm.stats().prefix_cache_queries > 0 and llm.stats().prefix_cache_hits == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert all(f"t-{n}.json" in row for row, n in zip(rows, names, strict=True))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--isl", "8"], "--isl cannot be combined with --cases"),
        (["--concurrency", "2"], "--concurrency cannot be combined with --cases"),
        (["--peer", "hf"], "--peer cannot be combined with --cases"),
        (["--dataset", "d.jsonl"], "--dataset cannot be combined with --cases"),
        (["--report-json", "out.json"], "--report-json='out.json' is invalid: with 2 cases"),
    ],
)
def test_throughput_cases_refuse_options_they_would_override(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "throughput", "--model", "dummy:tiny", "--cases", "2x8x4,2x8x4@1", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kiln bench throughput: error: ") and message in err, err


@pytest.mark.parametrize("spec", ["", "10x5", "10x5x5@", "0x5x5", "2x8x4@0", "2x8x4;2x8x4"])
def test_throughput_cases_name_a_malformed_case(spec: str, capsys) -> None:
    assert main(["bench", "throughput", "--model", "dummy:tiny", "--cases", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cases=" in err and "is invalid" in err, err


def test_throughput_cases_refuse_one_report_path_twice(capsys) -> None:
    argv = ["bench", "throughput", "--model", "dummy:tiny", "--cases", "2x8x4,2x8x4",
            "--report-json", "t-{case}.json"]  # fmt: skip
    assert main(argv) == 2
    assert "each case once when --report-json is written" in capsys.readouterr().err


def test_throughput_cases_check_every_length_before_running_any(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "t-{case}.json")
    argv = ["bench", "throughput", "--model", "dummy:tiny", "--no-progress", "--max-seq-len",
            "64", "--cases", "2x8x4,2x60x10", "--report-json", out]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cases='2x60x10' is invalid" in err and "max_seq_len (64" in err, err
    assert not list(tmp_path.iterdir())  # the first case did not run either


def test_bench_kernels_without_cuda_says_where_to_run(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this checks the message on a machine without CUDA")
    assert main(["bench", "kernels"]) == 2
    assert "no CUDA device; run it on the GPU machine" in capsys.readouterr().err


def test_bench_ceilings_prints_the_cpu_figures(capsys) -> None:
    assert main(["bench", "ceilings", "--device", "cpu", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["copy_bandwidth_bytes_per_s"] > 0 and "float32" in c["matmul_flops_per_s"]
