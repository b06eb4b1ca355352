"""GPU fast path end to end (``pytest -m gpu``; skipped without CUDA): kiln in bfloat16 on
the GPU, with CUDA graphs, against kiln's float32 reference on the CPU, and CUDA-graph
decode against eager decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.outputs import RequestOutput

from .util import report

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def small_llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama-3-style checkpoint (llama3 rope, GQA 4:1) saved by transformers on
    the CPU, so the CPU and the GPU load the very same weights. A wider initializer than
    transformers' default gives peaked next-token distributions, as trained models have."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        initializer_range=0.08,
        architectures=["LlamaForCausalLM"],
    )
    path = tmp_path_factory.mktemp("llama3s")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


PROMPTS = [list(range(7 + 13 * i, 7 + 13 * i + n)) for i, n in enumerate([3, 17, 64, 300, 1, 33])]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=5)


def _first_difference(a: RequestOutput, b: RequestOutput) -> int | None:
    """Index of the first differing greedy token, after checking the top-5 criterion there:
    each side's token is among the other's five most likely."""
    x, y = a.outputs[0], b.outputs[0]
    assert len(x.token_ids) == len(y.token_ids) == 32
    for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
        if s != t:
            assert t in x.logprobs[i] and s in y.logprobs[i], (i, s, t)
            return i
    return None


def test_gpu_bf16_agrees_with_cpu_fp32(small_llama3: Path) -> None:
    cpu = LLM(str(small_llama3), device="cpu", dtype="float32", max_seq_len=1024, progress=False)
    want = cpu.generate(PROMPTS, GREEDY, use_tqdm=False)
    del cpu
    gpu = LLM(str(small_llama3), device="cuda", dtype="bfloat16", max_seq_len=1024, progress=False)
    assert gpu.core.runner.graphs is not None
    got = gpu.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert gpu.core.runner.graph_steps > 0
    diffs = [_first_difference(a, b) for a, b in zip(want, got, strict=True)]
    report(
        "gpu_bf16_vs_cpu_fp32_greedy",
        {
            "model": "random Llama-3-style, 4 layers, hidden 1024, GQA 16:4, llama3 rope",
            "prompts": [len(p) for p in PROMPTS],
            "first_difference_per_prompt": diffs,
            "identical_32_token_continuations": sum(d is None for d in diffs),
            "criterion": "at the first differing greedy token within 32, each side's token "
            "is in the other's top-5",
            "graph_steps": gpu.core.runner.graph_steps,
            "eager_steps": gpu.core.runner.eager_steps,
        },
    )


def test_cuda_graph_decode_matches_eager(small_llama3: Path) -> None:
    """The same requests with decode steps as CUDA graphs and eagerly: 5 and 6 sequences
    pad to graphs of 8 rows; the padding rows touch only the null block."""
    kw = dict(device="cuda", dtype="bfloat16", max_seq_len=1024, progress=False)
    eager = LLM(str(small_llama3), enforce_eager=True, **kw)
    graphs = LLM(str(small_llama3), **kw)
    assert eager.core.runner.graphs is None
    assert graphs.core.runner.graphs is not None
    dg = graphs.core.runner.graphs
    assert 8 in dg.batch_sizes
    # every graph writes its logits into the first rows of one shared buffer
    assert all(out.data_ptr() == dg.logits.data_ptr() and out.shape[0] == b
               for b, (_, out) in dg.graphs.items())  # fmt: skip
    want = eager.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = graphs.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert eager.core.runner.graph_steps == 0 and graphs.core.runner.graph_steps >= 25
    diffs = [_first_difference(a, b) for a, b in zip(want, got, strict=True)]
    assert sum(d is None for d in diffs) >= len(PROMPTS) - 1, diffs
    # the logits of a decode step agree within bf16 tolerance
    for x, y in zip(want, got, strict=True):
        a, b = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        for tok in set(a) & set(b):
            assert abs(a[tok].logprob - b[tok].logprob) < 0.1
    assert graphs.stats().kv_cache_usage == 0.0
    # a long sampled run over many batch sizes as requests finish at different times
    mixed = [
        SamplingParams(max_tokens=8 + 9 * i, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(20)
    ]
    outs = graphs.generate([PROMPTS[i % 6] for i in range(20)], mixed, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8 + 9 * i for i in range(20)]
    assert graphs.stats().kv_cache_usage == 0.0


def test_overlapped_stepping_on_gpu(small_llama3: Path) -> None:
    """Overlap on (the CUDA default) against off: the same greedy continuations within the
    top-5 criterion (the batch shapes of steps differ, so near-ties may flip), every block
    back, and no placeholder in any output."""
    kw = dict(device="cuda", dtype="bfloat16", max_seq_len=1024, progress=False)
    llm = LLM(str(small_llama3), **kw)
    assert llm.core.overlap
    prompts = PROMPTS * 4
    params = [
        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=5)
        if i % 3
        else SamplingParams(max_tokens=32, temperature=0, logprobs=5, stop_token_ids=[5, 6])
        for i in range(len(prompts))
    ]
    over = llm.generate(prompts, params, use_tqdm=False)
    llm.core.overlap = False
    plain = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, over, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert -1 not in y.token_ids
        if x.finish_reason == y.finish_reason == "length":
            _first_difference(a, b)
    assert llm.stats().kv_cache_usage == 0.0


def test_few_device_operations_between_decode_graphs() -> None:
    """At one sequence, between two graph replays the device runs only the next step's
    input copies (the block table's only when a row changed), the sampler's upload, its
    kernel (and reduction) and the tokens' read-back: at most six operations (about 17
    before 2026-12-05: four more input copies, the placeholder patch's two copies and two
    kernels, five conversion and fill kernels). On the graphs' own stream only the
    inputs' copies and the sampler's kernels: the upload and the read-back run on a side
    stream (``kiln.runtime.side_copies``), so at most four, mostly three."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    llm = LLM("dummy:tiny", max_seq_len=256, max_batch_size=4, progress=False)
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm.generate([[5] * 8], p, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([[6] * 8], p, use_tqdm=False)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    ops = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: float(e["ts"]),
    )
    groups: dict[int, list[dict]] = {}
    for e in ops:
        if e.get("cat") == "kernel":
            groups.setdefault(e["args"].get("correlation", -1), []).append(e)
    replays = sorted((g for g in groups.values() if len(g) > 4), key=lambda g: float(g[0]["ts"]))
    assert len(replays) >= 12, len(replays)
    inside = {id(e) for g in replays for e in g}
    stream = replays[-1][0]["args"].get("stream")
    counts, on_stream = [], []
    for a, b in zip(replays[-11:-1], replays[-10:], strict=True):
        lo, hi = float(a[-1]["ts"]), float(b[0]["ts"])
        between = [e for e in ops if id(e) not in inside and lo < float(e["ts"]) < hi]
        counts.append(len(between))
        on_stream.append(sum(e["args"].get("stream") == stream for e in between))
    report("gpu-ops-between-graph-replays", {"batch": 1, "counts": counts,
                                             "on_graph_stream": on_stream})  # fmt: skip
    assert max(counts) <= 6, counts
    assert stream is not None and max(on_stream) <= 4, on_stream
    assert sorted(on_stream)[len(on_stream) // 2] <= 3, on_stream
