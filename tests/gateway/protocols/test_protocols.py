"""Per-route parsing (gateway/protocols): what each route's prompt is, and 400s naming the
field."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.errors import BadRequest
from gateway.protocols.messages import parse_messages
from gateway.protocols.multipart import multipart_model
from gateway.protocols.openai import ChatPrompt, CompletionPrompt, parse_request
from gateway.protocols.pooling import parse_pooling
from gateway.protocols.responses import parse_responses
from gateway.settings import ConfigError, parse_settings
from tests.conftest import lanes_config


def body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "qwen3.6", **fields})


def test_responses_items_become_vllm_chat_messages() -> None:
    routed = parse_responses(
        body(
            instructions="sys",
            input=[
                {"role": "user", "content": "q"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "a"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "r1"},
            ],
            max_output_tokens=7,
            previous_response_id="resp_1",
        )
    )
    assert isinstance(routed.prompt, ChatPrompt)
    roles = [m["role"] for m in routed.prompt.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in routed.prompt.messages[2]["tool_calls"]] == ["c1", "c2"]
    assert routed.max_tokens == 7 and routed.previous_response_id == "resp_1"


def test_a_partial_assistant_message_last_is_continued() -> None:
    item = {
        "type": "message",
        "role": "assistant",
        "status": "incomplete",
        "content": [{"type": "output_text", "text": "Hel"}],
    }
    routed = parse_responses(body(input=[{"role": "user", "content": "q"}, item]))
    assert isinstance(routed.prompt, ChatPrompt)
    assert routed.prompt.options.continue_final_message
    assert not routed.prompt.options.add_generation_prompt


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"type": "web_search_call"}]}, "input"),
        ({"input": "x", "instructions": 3}, "instructions"),
        ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
def test_bad_responses_requests_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_responses(body(**fields))
    assert caught.value.param == param


def test_anthropic_blocks_become_vllm_chat_messages() -> None:
    routed = parse_messages(
        body(
            max_tokens=5,
            system=[
                {"type": "text", "text": "a"},
                {"type": "text", "text": "x-anthropic-billing-header: 1"},
                {"type": "text", "text": "b"},
            ],
            messages=[
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "t"},
                        {"type": "tool_use", "id": "u1", "name": "f", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "u1",
                            "content": [{"type": "text", "text": "r"}],
                        }
                    ],
                },
            ],
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
        )
    )
    prompt = routed.prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.messages[0] == {"role": "system", "content": "ab"}
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "tool"]
    assert prompt.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert prompt.messages[3] == {"role": "tool", "tool_call_id": "u1", "content": "r"}
    assert prompt.tools[0]["function"] == {
        "name": "f",
        "description": None,
        "parameters": {"type": "object"},
        "defer_loading": None,
    }
    assert routed.max_tokens == 5


def test_bad_messages_requests_name_the_field() -> None:
    for fields, param in (
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "x"}, "tools"),
    ):
        with pytest.raises(BadRequest) as caught:
            parse_messages(body(**fields))
        assert caught.value.param == param


def test_pooling_routes_are_batches_of_sequences() -> None:
    score = parse_pooling("score", body(text_1="q", text_2=["a", "bb"])).prompt
    assert score == CompletionPrompt(texts=("qa", "qbb"))
    rerank = parse_pooling("rerank", body(query="q", documents=["a", {"text": "b"}])).prompt
    assert rerank == CompletionPrompt(texts=("qa", "qb"))
    ids = parse_pooling("embeddings", body(input=[[1, 2], [3]])).prompt
    assert ids == CompletionPrompt(token_ids=((1, 2), (3,)))
    chat = parse_pooling("embeddings", body(messages=[{"role": "user", "content": "x"}])).prompt
    assert isinstance(chat, ChatPrompt) and not chat.options.add_generation_prompt
    tokenize = parse_pooling("tokenize", body(messages=[{"role": "user", "content": "x"}])).prompt
    assert isinstance(tokenize, ChatPrompt) and tokenize.options.add_generation_prompt
    with pytest.raises(BadRequest):
        parse_pooling("score", body(queries=["a", "b"], documents=["c", "d", "e"]))
    with pytest.raises(BadRequest):
        parse_pooling("detokenize", body(tokens="abc"))


def test_chat_template_options_are_read_and_checked() -> None:
    prompt = parse_request(
        "chat",
        body(
            messages=[{"role": "user", "content": "x"}],
            chat_template_kwargs={"enable_thinking": False, "messages": "ignored"},
            documents=[{"title": "t", "text": "d"}],
        ),
    ).prompt
    assert isinstance(prompt, ChatPrompt)
    assert dict(prompt.options.kwargs) == {"enable_thinking": False}
    assert prompt.options.documents == ({"title": "t", "text": "d"},)
    with pytest.raises(BadRequest) as caught:
        parse_request(
            "chat",
            body(messages=[{"role": "user", "content": "x"}], continue_final_message=True),
        )
    assert caught.value.param == "continue_final_message"


def test_multipart_model_field_before_or_after_the_file() -> None:
    kind = b"multipart/form-data; boundary=b"
    model = b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nqwen3.6\r\n'
    audio = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
    audio += b"\0" * 200_000 + b'name="model"' + b"\0" * 200_000 + b"\r\n"
    assert multipart_model(kind, model + audio + b"--b--\r\n") == "qwen3.6"
    assert multipart_model(kind, audio + model + b"--b--\r\n") == "qwen3.6"
    with pytest.raises(BadRequest) as caught:  # 'name="model"' inside the audio is not a field
        multipart_model(kind, audio + b"--b--\r\n")
    assert caught.value.param == "model"
    with pytest.raises(BadRequest):
        multipart_model(b"application/json", model)


def test_route_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="cannot be forwarded"):
        parse_settings(
            lanes_config(["http://a"], ["http://b"], routes={"forward_headers": ["Authorization"]}),
            environ={},
        )
    with pytest.raises(ConfigError, match="multipart_lane"):
        parse_settings(
            lanes_config(["http://a"], ["http://b"], routes={"multipart_lane": "nope"}), environ={}
        )
    settings = parse_settings(lanes_config(["http://a"], ["http://b"]), environ={})
    assert settings.multipart_lane == "fast"
