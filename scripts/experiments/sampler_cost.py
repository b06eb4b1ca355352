"""What the sampler's options cost a decode step on the GPU: a 2-layer Llama-3.1-8B (vocab
128,256, so the sampler's (rows, vocab) work is a large share of the step) at 256 and 64
rows, each option on every row, 64 tokens a row, against greedy; top-p also through the
sort-free kernel (kiln.kernels.top_p; its compile falls in the first of two runs), the
costly set with the sampler's (rows, vocab) work in one chunk of rows, and 20 logprobs with
the start-up heap frozen (kiln.runtime.heap, as kiln serve and kiln bench run). Then, on
random rows, the logprobs' device half and its parts, and their host half, alone. Each
run's wall time less a 1-token run's (the prefill) over 63 steps is the step; the memory
rise is over the memory in use before the run.
The costly set is tests/util.costly_sampling_params's.

Usage on the GPU machine: PYTHONPATH=. python scripts/experiments/sampler_cost.py OUT.json"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch

from kiln import LLM, SamplingParams
from kiln.kernels import top_p
from kiln.runtime import filters, heap
from kiln.runtime.logprobs import build_logprob_dicts, logprob_tensors

TOKENS = 64
OPTIONS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_k_50": {"temperature": 0.8, "top_k": 50},
    "top_p_0.9": {"temperature": 0.8, "top_p": 0.9},
    "top_k_50_top_p_0.9": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "min_p_0.05": {"temperature": 0.8, "min_p": 0.05},
    "penalties": {
        "temperature": 0.8,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.2,
    },
    "logprobs_20": {"temperature": 0.0, "logprobs": 20},
    "seeded": {"temperature": 0.8, "seed": 7},
}


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == params[0].max_tokens for o in outs)
    return wall, torch.cuda.max_memory_allocated() - base if cuda else 0


def _params(opts: dict[str, Any], rows: int, n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True, **opts) for _ in range(rows)]


def _thresholds_alone(vocab: int) -> dict[str, Any]:
    """Top-p (0.9, temperature 1) keep-thresholds of random rows alone, CUDA events over 20
    calls: the sampler's sort path (chunked as keep_thresholds does) and the kernel."""
    out: dict[str, Any] = {}
    top_p.MIN_ROWS = 1  # the kernel at every row count
    for rows in (1, 16, 64, 256):
        x = torch.randn(rows, vocab, device="cuda") * 3
        inv, m = torch.ones(rows, device="cuda"), torch.zeros(rows, device="cuda")
        p, k = torch.full((rows,), 0.9, device="cuda"), torch.full((rows,), vocab, device="cuda")
        plan = filters.FilterPlan(sort=list(range(rows)))
        idx = torch.arange(rows, device="cuda")
        groups = {"minp": idx[:0], "topk": idx[:0], "sort": idx}
        for kernel in (False, True):
            top_p.ENABLED = kernel
            name = "kernel" if kernel else "sort"
            # (the first call, untimed, compiles)
            out[f"{rows}/{name}"] = _timed(
                lambda: filters.keep_thresholds(x, inv, k, p, m, plan, groups), "cuda"
            )
            thr = filters.keep_thresholds(x, inv, k, p, m, plan, groups)
            out[f"{rows}/thr_sum/{name}"] = float(thr.sum())
        print("thresholds alone (ms)", rows, out[f"{rows}/sort"], out[f"{rows}/kernel"], flush=True)
    top_p.ENABLED = False
    return out


def _timed(fn: Any, dev: str, n: int = 20) -> float:
    """ms a call of ``fn`` over ``n`` calls after one (CUDA events on the GPU)."""
    fn()
    if dev != "cuda":
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return round((time.perf_counter() - t) / n * 1e3, 4)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(n):
        fn()
    ev[1].record()
    torch.cuda.synchronize()
    return round(ev[0].elapsed_time(ev[1]) / n, 4)


def _logprobs_alone(vocab: int, dev: str, kmax: int = 20) -> dict[str, Any]:
    """Where 20 logprobs a row go, each part alone on random rows: the device half as the
    sampler runs it (log_softmax of the rows, then logprob_tensors: the chosen token's
    logprob, its rank by a comparison sum, top-kmax; packed as float64) and its parts, and
    the host half (build_logprob_dicts on a list of the packed size)."""
    out: dict[str, Any] = {}
    for rows in (256, 64):
        x = torch.randn(rows, vocab, device=dev) * 3
        ids = torch.randint(0, vocab, (rows,), device=dev)
        lp = torch.log_softmax(x.float(), -1)

        def device_half() -> torch.Tensor:
            parts = logprob_tensors(torch.log_softmax(x.float(), -1), ids, kmax)
            return torch.cat([t.flatten().double() for t in parts])

        out[f"{rows}/device_ms"] = _timed(device_half, dev)
        out[f"{rows}/log_softmax_ms"] = _timed(lambda: torch.log_softmax(x.float(), -1), dev)
        out[f"{rows}/rank_ms"] = _timed(lambda: (lp > lp[:, :1]).sum(-1), dev)
        out[f"{rows}/topk_ms"] = _timed(lambda: lp.topk(kmax, dim=-1), dev)
        flat = device_half().tolist()
        toks = ids.tolist()
        out[f"{rows}/host_ms"] = _timed(
            lambda: build_logprob_dicts(toks, [kmax] * rows, kmax, flat), "cpu"
        )
        mine = {k: v for k, v in out.items() if k.startswith(f"{rows}/")}
        print("logprobs alone (ms)", rows, mine, flush=True)
    return out


def main(out: str) -> None:
    sys.path.insert(0, "tests")
    from util import costly_sampling_params

    # (SAMPLER_COST_MODEL=dummy:tiny SAMPLER_COST_DEVICE=cpu: a CPU check of the script)
    src = os.environ.get("SAMPLER_COST_MODEL", "dummy:llama-3.1-8b,num_hidden_layers=2")
    dev = os.environ.get("SAMPLER_COST_DEVICE", "cuda")
    llm = LLM(src, device=dev, max_seq_len=512, max_num_tokens=4096, max_batch_size=256,
              progress=False)  # fmt: skip
    card = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    res: dict[str, Any] = {"model": src, "device": card, "tokens": TOKENS, "runs": {}}
    res["activation_peak_bytes"] = llm.activation_peak_bytes
    for rows in (256, 64):
        vocab = llm.config.vocab_size
        prompts = [[(31 * i + 7 * j) % vocab for j in range(16)] for i in range(rows)]
        sets = {k: (_params(o, rows, TOKENS), _params(o, rows, 1)) for k, o in OPTIONS.items()}
        costly = costly_sampling_params(rows, max_tokens=TOKENS, min_tokens=0)
        one = costly_sampling_params(rows, max_tokens=1, min_tokens=0)
        for p in costly + one:  # every row its full length
            p.ignore_eos, p.stop_token_ids = True, []
        sets["costly"] = (costly, one)
        _run(llm, prompts, sets["greedy"][0])  # warm-up
        # the rows with top-p and no top-k through the sort-free kernel (KILN_TOP_P_KERNEL)
        for name in ("top_p_0.9", "costly"):
            sets[f"{name}/top_p_kernel"] = sets[name]
        # and the sampler's (R, V) work in one chunk (before ddbac0c: its launch count)
        sets["costly/one_chunk"] = sets["costly"]
        # and with the start-up heap frozen, as kiln serve and kiln bench run (runtime.heap)
        sets["logprobs_20/frozen_heap"] = sets["logprobs_20"]
        chunk_rows = filters._CHUNK_ROWS
        top_p.MIN_ROWS = 1  # on or off by name alone
        for name, (full, first) in sets.items():
            top_p.ENABLED = name.endswith("/top_p_kernel")
            filters._CHUNK_ROWS = 1 << 30 if name.endswith("/one_chunk") else chunk_rows
            walls = []
            with heap.frozen() if name.endswith("/frozen_heap") else nullcontext():
                for _ in range(2):
                    w1, _ = _run(llm, prompts, first)
                    wn, rise = _run(llm, prompts, full)
                    walls.append((wn - w1) / (TOKENS - 1) * 1e3)
            res["runs"][f"{rows}/{name}"] = {"step_ms": [round(w, 3) for w in walls],
                                             "rise_bytes": rise}  # fmt: skip
            print(rows, name, res["runs"][f"{rows}/{name}"], flush=True)
    top_p.ENABLED, filters._CHUNK_ROWS = False, chunk_rows
    res["logprobs_alone"] = _logprobs_alone(llm.config.vocab_size, dev)
    if dev == "cuda":
        res["thresholds_alone"] = _thresholds_alone(llm.config.vocab_size)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
