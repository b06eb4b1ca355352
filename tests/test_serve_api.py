"""``kiln serve`` endpoints and protocol fidelity, through the official ``openai`` client
against a real server process (loopback only), plus raw SSE checks and config parsing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kiln.errors import ConfigError
from kiln.serve.config import EMBEDDED_MODEL_NAME, make_config
from tests.serve_util import Server, assert_openai_error, sse_events, stream_post

MODEL = EMBEDDED_MODEL_NAME
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def client(served: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_version_health_metrics(served: Server, client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    import kiln

    assert httpx.get(served.url + "/version").json() == {"version": kiln.__version__}
    h = httpx.get(served.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = httpx.get(served.url + "/metrics").text
    for name in (
        "kiln:num_requests_running",
        "kiln:num_requests_waiting",
        "kiln:kv_cache_usage_perc",
        "kiln:num_preemptions_total",
        "kiln:prompt_tokens_total",
        "kiln:generation_tokens_total",
        "kiln:time_to_first_token_seconds_bucket",
        "kiln:inter_token_latency_seconds_bucket",
        "kiln:e2e_request_latency_seconds_bucket",
        "kiln:request_queue_time_seconds_bucket",
    ):
        assert name in text, name


def test_completion_stream_equals_non_stream(client: openai.OpenAI, smollm2_llm: Any) -> None:
    prompt = "Once upon a time"
    kw: dict[str, Any] = dict(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9, top_p=0.95, seed=7
    )
    full = client.completions.create(**kw, logprobs=2)
    choice = full.choices[0]
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == choice.finish_reason == "length" and not any(reasons[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    n_prompt = len(smollm2_llm.tokenizer.encode(prompt))
    for u in (full.usage, usage):
        assert u.prompt_tokens == n_prompt
        assert u.completion_tokens == 12 == len(choice.logprobs.tokens)
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert all(len(t) >= 1 for t in choice.logprobs.top_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=CHAT, temperature=0.8, seed=3)
    full = client.chat.completions.create(**kw, max_completion_tokens=10)
    chunks = list(
        client.chat.completions.create(
            **kw, max_tokens=10, stream=True, stream_options={"include_usage": True}
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in with_choices[1:])
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in with_choices]
    assert reasons[-1] is not None and not any(reasons[:-1])
    u = chunks[-1].usage
    assert u is not None and u.model_dump() == full.usage.model_dump()
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert full.choices[0].message.role == "assistant"


def test_raw_sse_ends_with_done(served: Server) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stream": True}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "stream": True}),
    ):
        events, done = sse_events(stream_post(served.url, path, body))
        assert done and events
        assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_sampling_options(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="1, 2, 3,",
        max_tokens=8,
        n=2,
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=1,
        stop=["9"],
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all("9" not in c.text for c in r.choices)
    assert r.usage.completion_tokens <= 16
    greedy = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0)
    echo = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0, echo=True, logprobs=1
    )
    assert echo.choices[0].text == "1, 2, 3," + greedy.choices[0].text
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == echo.usage.total_tokens
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=3, temperature=0
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].token == content[0].top_logprobs[0].token  # greedy picks the top


def test_echo_with_max_tokens_zero_scores_the_prompt(served: Server, client: openai.OpenAI) -> None:
    """max_tokens=0 with echo (how OpenAI-style eval harnesses score text): the prompt and its
    logprobs come back, nothing is generated; streamed the same; refused without echo."""
    prompt = "1, 2, 3, 4,"
    kw: dict[str, Any] = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2}
    zero = client.completions.create(max_tokens=0, **kw)
    more = client.completions.create(max_tokens=3, temperature=0, **kw)
    c, n = zero.choices[0], zero.usage.prompt_tokens
    assert (c.text, c.finish_reason, zero.usage.completion_tokens) == (prompt, "length", 0)
    assert zero.usage.total_tokens == n == more.usage.prompt_tokens
    lp, ref = c.logprobs, more.choices[0].logprobs
    assert len(lp.tokens) == n and lp.token_logprobs[0] is None
    assert lp.tokens == ref.tokens[:n] and lp.text_offset == ref.text_offset[:n]
    assert lp.token_logprobs == ref.token_logprobs[:n] and lp.top_logprobs == ref.top_logprobs[:n]
    chunks = list(client.completions.create(max_tokens=0, stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == prompt
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [
        t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens
    ] == lp.tokens
    r = httpx.post(served.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    err = assert_openai_error(r, 400, "max_tokens")
    assert "max_tokens=0" in err["message"] and "echo" in err["message"], err


def test_prompt_logprobs_field_vllm_style(
    served: Server, client: openai.OpenAI, smollm2_llm: Any
) -> None:
    """vLLM's ``prompt_logprobs`` extension: per prompt token None (the first) or its
    logprob, rank and decoded text with the k most likely; on completions per choice, on
    chat for the response; equal to echo's logprobs; refused with stream=true."""
    prompt = "1, 2, 3, 4,"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})  # fmt: skip
    plp = r.choices[0].model_extra["prompt_logprobs"]
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=1)  # fmt: skip
    lp = echo.choices[0].logprobs
    n = r.usage.prompt_tokens
    assert len(plp) == n == len(lp.tokens) and plp[0] is None
    ids = smollm2_llm.tokenizer.encode(prompt)
    for i in range(1, n):
        entry = plp[i]
        mine = entry[str(ids[i])]
        assert mine["decoded_token"] == lp.tokens[i]
        assert abs(mine["logprob"] - lp.token_logprobs[i]) < 1e-6
        assert {v["rank"] for t, v in entry.items() if t != str(ids[i])} <= {1, 2, 3}
        assert len(entry) in (3, 4) and sum(v["rank"] <= 3 for v in entry.values()) == 3
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})  # fmt: skip
    cp = chat.model_extra["prompt_logprobs"]
    assert len(cp) == chat.usage.prompt_tokens and cp[0] is None
    assert all(len(e) == 1 for e in cp[1:])  # the prompt token alone
    body = {"prompt": prompt, "prompt_logprobs": 1, "stream": True}
    err = assert_openai_error(httpx.post(served.url + "/v1/completions", json=body), 400,
                              "prompt_logprobs")  # fmt: skip
    assert "stream" in err["message"], err


def test_batched_prompts(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["Hello", "Bye"], max_tokens=3, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    r = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 4
    chunks = list(
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3, stream=True)
    )
    done = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(done) == [0, 1]


def test_errors_have_openai_shape(served: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e2:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e2.value.code == "model_not_found"
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "temperature": -1})
    assert_openai_error(r, 400, "temperature")
    assert_openai_error(httpx.get(served.url + "/v1/nope"), 404, None)


def test_unknown_fields_are_ignored_by_default(served: Server) -> None:
    r = httpx.post(
        served.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "not_a_field": 1},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def test_config_from_yaml_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("port: 9001\nmax-n: 3\nshutdown_timeout: 2.5\napi_key: from-file\n")
    c = make_config(f, {"port": 9002}, environ={"KILN_API_KEY": "from-env"})
    assert (c.port, c.max_n, c.shutdown_timeout, c.api_key, c.host) == (
        9002,
        3,
        2.5,
        "from-file",
        "127.0.0.1",
    )
    assert make_config(None, {}, environ={"KILN_API_KEY": "k"}).api_key == "k"
    f.write_text("max_nn: 3\n")
    with pytest.raises(ConfigError, match="max_nn"):
        make_config(f, {})
    f.write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match="mapping"):
        make_config(f, {})
    with pytest.raises(ConfigError, match="max_n=0"):
        make_config(None, {"max_n": 0})


def test_kv_cache_and_graph_options_from_flags_reach_the_engine(tmp_path: Path) -> None:
    from kiln.cli import parser
    from kiln.serve.app import load_llm

    a = parser().parse_args(["serve", "--model", "dummy:tiny", "--kv-cache-dtype", "fp8",
                             "--kv-cache-free-gpu-memory-fraction", "0.5", "--no-prefix-caching",
                             "--enforce-eager", "--kv-cache-max-tokens", "256"])  # fmt: skip
    flags = {k: v for k, v in vars(a).items() if k not in ("command", "func", "config")}
    c = make_config(None, flags)
    assert (c.kv_cache_dtype, c.kv_cache_free_gpu_memory_fraction) == ("fp8", 0.5)
    assert (c.enable_prefix_caching, c.enforce_eager) == (False, True)
    kw = c.llm_kwargs()
    assert kw["kv_cache_dtype"] == "fp8" and kw["enforce_eager"] is True
    kv = kw["kv_cache_config"]
    assert (kv.free_gpu_memory_fraction, kv.enable_block_reuse, kv.max_tokens) == (0.5, False, 256)
    llm = load_llm(c)
    assert llm.kv_cache_dtype == "fp8" and llm.kv_capacity_tokens == 256
    assert not llm.kv_cache_config.enable_block_reuse
    # unset flags leave the defaults (and a YAML file's values) alone
    d = make_config(None, {k: v for k, v in vars(parser().parse_args(["serve"])).items()
                           if k not in ("command", "func", "config")})  # fmt: skip
    assert (d.kv_cache_dtype, d.kv_cache_free_gpu_memory_fraction) == ("auto", 0.9)
    assert (d.enable_prefix_caching, d.enforce_eager) == (True, False)
    assert d.llm_kwargs()["kv_cache_dtype"] is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kv_cache_free_gpu_memory_fraction", 0, "a number in (0, 1]"),
        ("kv_cache_free_gpu_memory_fraction", 1.01, "a number in (0, 1]"),
        ("kv_cache_free_gpu_memory_fraction", "half", "a number in (0, 1]"),
        ("kv_cache_dtype", "int8", "one of auto, fp8"),
        ("enable_prefix_caching", "no", "true or false"),
        ("enforce_eager", 1, "true or false"),
    ],
)
def test_kv_cache_options_name_a_bad_value(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=field) as e:
        make_config(None, {field: value})
    assert message in str(e.value)
