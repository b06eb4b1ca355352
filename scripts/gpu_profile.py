"""Where a step's time goes on the GPU: dummy Llama-3.1-8B bf16, 1,024 requests of 128/128
at max_batch_size 512; torch.profiler over a few prefill and decode steps. Ad-hoc, not a
committed benchmark: prints per-step wall times and the top operators by GPU and CPU time."""

import json
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kiln import LLM, SamplingParams

bsz = int(sys.argv[1]) if len(sys.argv) > 1 else 512
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
llm = LLM(
    "dummy:llama-3.1-8b", device="cuda", max_seq_len=512, max_batch_size=bsz,
    max_num_tokens=8192, progress=False,
)  # fmt: skip
rng = random.Random(0)
prompts = [[rng.randrange(128256) for _ in range(128)] for _ in range(n)]
p = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
core = llm.core
for r in [core.make_request(x, p) for x in prompts]:
    core.add_request(r)
core.step_log = []
torch.cuda.synchronize()
t0 = time.perf_counter()
prof_steps = {0, 1, 40, 41, 42}
i = 0
while core.has_unfinished():
    if i in prof_steps:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            core.step(only_finished=True)
            torch.cuda.synchronize()
        kind = "prefill" if core.step_log[-1].num_prefill_tokens else "decode"
        print(f"== step {i} ({kind}, {core.step_log[-1].num_seqs} seqs)")
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    else:
        core.step(only_finished=True)
    i += 1
torch.cuda.synchronize()
dt = time.perf_counter() - t0
# which host operations of a decode step synchronize with the device
import traceback  # noqa: E402
import warnings  # noqa: E402


def _show(message, category, filename, lineno, file=None, line=None):
    print(f"SYNC: {message}".splitlines()[0])
    print("".join(traceback.format_stack(limit=8)[:-1]))


warnings.showwarning = _show
warnings.simplefilter("always")
for r in [core.make_request(x, p) for x in prompts[:64]]:
    core.add_request(r)
for i in range(12):
    if i == 10:
        torch.cuda.set_sync_debug_mode("warn")
    core.step(only_finished=True)
    torch.cuda.set_sync_debug_mode(0)
while core.has_unfinished():
    core.step(only_finished=True)
log = core.step_log
dec = [r.end - r.start for r in log if r.num_prefill_tokens == 0]
pre = [r.end - r.start for r in log if r.num_prefill_tokens > 0]
print(json.dumps({
    "max_batch": bsz, "requests": n, "seconds": dt, "out_tok_s": n * 128 / dt,
    "decode_steps": len(dec), "decode_ms_mean": 1000 * sum(dec) / max(1, len(dec)),
    "prefill_steps": len(pre), "prefill_ms": [round(1000 * x) for x in pre],
    "graph_steps": core.runner.graph_steps, "eager_steps": core.runner.eager_steps,
}))  # fmt: skip
