"""Experiment (H200): how much of a decode step is the CUDA graph. For each engine and
batch size, the time per step of ``LLM.generate`` (b prompts of 128 random tokens, 256
tokens more than a 1-token run, ``ignore_eos``: everything the engine does per step) against
back-to-back replays of the captured graph alone (inputs: contexts of 192 tokens in the
null block). The difference is the step's work outside the graph: input copies, the
placeholder patch, sampling, and any time the GPU waits for the host.

Usage: ``python scripts/experiments/step_replay.py OUT.json ENGINE_DIR...``"""

import json
import sys
import time
from pathlib import Path

import torch

from kiln.llm import LLM
from kiln.sampling_params import SamplingParams

BATCHES = (1, 8, 16)


def generate_s(llm: LLM, b: int, n: int) -> float:
    g = torch.Generator().manual_seed(b)
    prompts = [torch.randint(100, 20000, (128,), generator=g).tolist() for _ in range(b)]
    p = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, p, use_tqdm=False)
    return time.perf_counter() - t


def replay_ms(llm: LLM, b: int, n: int = 200) -> float:
    graphs = llm.core.runner.graphs
    kv = llm.core.runner.kv
    graphs.inputs.reset(kv.null_block, kv.tokens_per_block)
    graphs.inputs.views(b)[3].fill_(192)
    graph, _ = graphs.graphs[b]
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "engines": {}}
    for path in sys.argv[2:]:
        llm = LLM(path)
        rows = {}
        for b in BATCHES:
            generate_s(llm, b, 32)  # warm
            one = min(generate_s(llm, b, 1) for _ in range(3))
            full = min(generate_s(llm, b, 257) for _ in range(3))
            step = (full - one) / 256 * 1e3
            rep = min(replay_ms(llm, b) for _ in range(3))
            rows[b] = {"step_ms": round(step, 4), "replay_ms": round(rep, 4),
                       "outside_ms": round(step - rep, 4)}  # fmt: skip
            print(path, b, rows[b], flush=True)
        out["engines"][path] = rows
        del llm
        torch.cuda.empty_cache()
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
