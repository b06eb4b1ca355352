"""What a step of prompt logprobs allocates beyond the memory in use, against the activation
peak the KV cache was sized around: chunked (the engine's ``prompt_logprob_rows``) and each
request's 2,000 rows at once (before the chunking the runner held the whole step's 8,000
rows of logits besides, so it allocated more still). Same engine as the GPU test
tests/test_gpu.py::test_prompt_logprobs_stay_within_the_measured_peak.

Usage on the GPU machine: python scripts/experiments/prompt_logprob_peak.py OUT.json"""

from __future__ import annotations

import json
import sys

import torch

from kiln import LLM, SamplingParams


def main(out: str) -> None:
    src = "dummy:llama-3.1-8b,num_hidden_layers=2"
    llm = LLM(src, device="cuda", max_seq_len=4096, max_num_tokens=8192, max_batch_size=16,
              progress=False, enforce_eager=True)  # fmt: skip
    prompts = [[(13 * i + 7 * j) % 128000 for j in range(2000)] for i in range(4)]
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=20)
    rows = {"chunked": llm.core.prompt_logprob_rows, "per_request": 8192}
    res: dict = {"activation_peak_bytes": llm.activation_peak_bytes, "runs": {}}
    for name, r in rows.items():
        llm.core.prompt_logprob_rows = r
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            llm.generate(prompts, p)
            rise = torch.cuda.max_memory_allocated() - base
            res["runs"][name] = {"rows": r, "rise_bytes": rise}
        except torch.OutOfMemoryError as e:
            res["runs"][name] = {"rows": r, "error": str(e)[:300]}
        print(name, res["runs"][name], flush=True)
    res["free_after_bytes"] = torch.cuda.mem_get_info()[0]
    res["device"] = torch.cuda.get_device_name()
    print(json.dumps(res))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
