import time, torch, random, json, os
from kiln import LLM, SamplingParams

for bsz in (512,):
    llm = LLM(
        "dummy:llama-3.1-8b",
        device="cuda",
        max_seq_len=512,
        max_batch_size=bsz,
        max_num_tokens=8192,
        progress=False,
    )
    rng = random.Random(0)
    n = 1024
    prompts = [[rng.randrange(128256) for _ in range(128)] for _ in range(n)]
    p = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.core.step_log = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, p, use_tqdm=False)
    dt = time.perf_counter() - t
    log = llm.core.step_log
    dec = [r.end - r.start for r in log if r.num_prefill_tokens == 0]
    pre = [r.end - r.start for r in log if r.num_prefill_tokens > 0]
    print(
        json.dumps(
            {
                "max_batch": bsz,
                "requests": n,
                "seconds": dt,
                "out_tok_s": n * 128 / dt,
                "steps": len(log),
                "decode_steps": len(dec),
                "decode_step_ms_mean": 1000 * sum(dec) / max(1, len(dec)),
                "prefill_steps": len(pre),
                "prefill_step_ms_mean": 1000 * sum(pre) / max(1, len(pre)),
                "peak_kv": llm.stats().peak_kv_cache_usage,
            }
        ),
        flush=True,
    )
    del llm
    torch.cuda.empty_cache()
