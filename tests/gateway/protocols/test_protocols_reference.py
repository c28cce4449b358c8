"""The gateway's count equals the reference on generated Responses, Messages and embeddings
requests: the model's own chat template rendered by ``transformers``' ``apply_chat_template`` on
the offline Qwen3.6 tokenizer folder, after converting each request to chat messages the way
vLLM does (written here a second time, independently, from vLLM's source: Responses items in
``vllm/entrypoints/openai/responses/utils.py``, Anthropic blocks in
``vllm/entrypoints/anthropic/serving.py``, tool dumps through pydantic models shaped like
vLLM's ``FunctionDefinition`` and the openai SDK's ``FunctionTool``).
"""

from __future__ import annotations

import json
import os
import random
import zipfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.types.responses import FunctionTool
from pydantic import BaseModel, ConfigDict

from gateway.count.tokens import TokenCounter
from gateway.protocols.messages import parse_messages
from gateway.protocols.pooling import parse_pooling
from gateway.protocols.responses import parse_responses
from gateway.settings import parse_settings
from tests.conftest import MODEL, ROOT, lanes_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

REQUESTS_PER_ROUTE = 60
DATA = ROOT / "gateway" / "count" / "tokenizer_data" / "qwen3.6"


# -- the reference ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers' tokenizer for the shipped Qwen3.6 files, from a folder, offline."""
    folder = tmp_path_factory.mktemp("qwen3.6")
    with zipfile.ZipFile(DATA / "tokenizer.json.zip") as archive:
        archive.extractall(folder)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((DATA / name).read_bytes())
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def hf_counter() -> TokenCounter:
    model = {**MODEL, "tokenizer": {**MODEL["tokenizer"], "chat_template": "hf"}}
    config = lanes_config(["http://x"], ["http://y"], models=[model])
    return TokenCounter.from_settings(parse_settings(config, environ={}))


class FunctionDefinition(BaseModel):  # vLLM's, extra fields allowed (OpenAIBaseModel)
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolParam(BaseModel):  # vLLM's ChatCompletionToolsParam
    model_config = ConfigDict(extra="allow")
    type: str = "function"
    function: FunctionDefinition


def vllm_chat_ready(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM 0.32's chat preprocessing for Qwen3.6's template, which it reads as the "openai"
    content format: text parts reach the template as a list (the template concatenates them),
    a tool message's parts joined with "\\n"; tool-call arguments parsed."""
    out = []
    for original in messages:
        message = dict(original)
        content = message.get("content")
        if isinstance(content, list):
            parts = [{"type": "text", "text": p["text"]} for p in content if "text" in p]
            tool = message.get("role") == "tool"
            message["content"] = "\n".join(p["text"] for p in parts) if tool else parts
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call["function"])
                function["arguments"] = json.loads(function["arguments"])
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


def reference_count(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    continue_final: bool = False,
) -> int:
    ids = tokenizer.apply_chat_template(
        vllm_chat_ready(messages),
        tools=tools or None,
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
        tokenize=True,
        **kwargs,
    )
    return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


# -- generated requests -----------------------------------------------------------------------

TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "请用中文总结这段文字，并列出三个要点。",  # noqa: RUF001 - CJK punctuation on purpose
    "東京の天気はどうですか？明日は雨が降るでしょう。",  # noqa: RUF001
    "def add(a, b):\n    return a + b\n",
    '{"id": 17, "tags": ["x", "y"], "ok": true}',
    "Résumé naïve café — 🙂 emoji and accents.",
    "  padded text with surrounding spaces  ",
    "한국어 문장도 섞어 봅니다.",
)


def text(rng: random.Random) -> str:
    return " ".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 4)))


def schema(rng: random.Random) -> dict[str, Any]:
    props = {
        f"arg{i}": {"type": rng.choice(["string", "integer"]), "description": rng.choice(TEXTS)}
        for i in range(rng.randint(1, 3))
    }
    return {"type": "object", "properties": props, "required": sorted(props)[:1]}


def arguments(rng: random.Random) -> dict[str, Any]:
    return {"arg0": rng.choice([text(rng), rng.randint(0, 999)]), "city": rng.choice(TEXTS[:3])}


def thinking(rng: random.Random) -> dict[str, Any]:
    choice = rng.choice([None, True, False])
    return {} if choice is None else {"chat_template_kwargs": {"enable_thinking": choice}}


def responses_request(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "qwen3.6", **thinking(rng)}
    if rng.random() < 0.6:
        body["instructions"] = text(rng)
    if rng.random() < 0.5:
        body["tools"] = [
            {"type": "function", "name": f"tool_{i}", "parameters": schema(rng)}
            | ({"description": text(rng)} if rng.random() < 0.5 else {})
            | ({"strict": True} if rng.random() < 0.3 else {})
            for i in range(rng.randint(1, 3))
        ]
    if rng.random() < 0.25:
        body["input"] = text(rng)
        return body
    items: list[dict[str, Any]] = []
    for turn in range(rng.randint(1, 3)):
        user: Any = text(rng)
        if rng.random() < 0.4:
            user = [{"type": "input_text", "text": text(rng)} for _ in range(rng.randint(1, 2))]
        items.append({"role": "user", "content": user} | ({"type": "message"} if turn else {}))
        if rng.random() < 0.6:
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text(rng), "annotations": []}],
                }
            )
        for call in range(rng.randint(0, 2)):
            call_id = f"call_{turn}_{call}"
            items.append(
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": f"tool_{call}",
                    "arguments": json.dumps(arguments(rng), ensure_ascii=rng.random() < 0.5),
                }
            )
            items.append({"type": "function_call_output", "call_id": call_id, "output": text(rng)})
    body["input"] = items
    return body


def vllm_responses(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """construct_input_messages + construct_tool_dicts, re-read from vLLM."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    if isinstance(body["input"], str):
        messages.append({"role": "user", "content": body["input"]})
    else:
        for item in body["input"]:
            prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
            if item.get("type") == "function_call":
                call = {
                    "id": item["call_id"],
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                    "type": "function",
                }
                if prev is not None:
                    prev.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "tool_calls": [call]})
            elif item.get("type") == "function_call_output":
                messages.append(
                    {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}
                )
            elif item.get("role") == "assistant":
                if prev is not None and prev.get("content") is None:
                    prev["content"] = item["content"][0]["text"]
                else:
                    messages.append({"role": "assistant", "content": item["content"][0]["text"]})
            else:
                messages.append(item)
    tools = []
    for tool in body.get("tools", []):
        dumped = FunctionTool.model_validate(tool).model_dump()
        function = FunctionDefinition.model_validate(
            {k: v for k, v in dumped.items() if k != "type"}
        )
        tools.append(ToolParam(type="function", function=function).model_dump())
    return messages, tools


def messages_request(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "qwen3.6", "max_tokens": 64, **thinking(rng)}
    if rng.random() < 0.4:
        body["system"] = text(rng)
    elif rng.random() < 0.5:
        body["system"] = [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.5:
        body["tools"] = [
            {"name": f"tool_{i}", "input_schema": schema(rng)}
            | ({"description": text(rng)} if rng.random() < 0.5 else {})
            for i in range(rng.randint(1, 3))
        ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(rng)}]
    for turn in range(rng.randint(0, 2)):
        calls = [
            {
                "type": "tool_use",
                "id": f"toolu_{turn}_{i}",
                "name": f"tool_{i}",
                "input": arguments(rng),
            }
            for i in range(rng.randint(0, 2))
        ]
        assistant: list[dict[str, Any]] = [{"type": "text", "text": text(rng)}, *calls]
        messages.append({"role": "assistant", "content": assistant})
        results: list[dict[str, Any]] = []
        for call in calls:
            content: Any = text(rng)
            if rng.random() < 0.5:
                content = [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 2))]
            results.append({"type": "tool_result", "tool_use_id": call["id"], "content": content})
        user: Any = [*results, {"type": "text", "text": text(rng)}]
        if not results and rng.random() < 0.5:
            user = text(rng)
        messages.append({"role": "user", "content": user})
    body["messages"] = messages
    return body


def vllm_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """_convert_anthropic_to_openai_request, re-read from vLLM (text, tool_use, tool_result)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        joined = system if isinstance(system, str) else "".join(b["text"] for b in system)
        out.append({"role": "system", "content": joined})
    for msg in body["messages"]:
        converted: dict[str, Any] = {"role": msg["role"]}
        if isinstance(msg["content"], str):
            converted["content"] = msg["content"]
            out.append(converted)
            continue
        parts, calls = [], []
        for block in msg["content"]:
            if block["type"] == "text":
                parts.append({"type": "text", "text": block["text"]})
            elif block["type"] == "tool_use":
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {
                            "name": block["name"],
                            "arguments": json.dumps(block["input"]),
                        },
                    }
                )
            elif block["type"] == "tool_result":
                content = block["content"]
                if isinstance(content, list):
                    content = "\n".join(item["text"] for item in content)
                out.append(
                    {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
                )
        if calls:
            converted["tool_calls"] = calls
        if parts:
            converted["content"] = parts[0]["text"] if len(parts) == 1 else parts
        if not (msg["role"] == "user" and "content" not in converted):
            out.append(converted)
    tools = [
        ToolParam.model_validate(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description"),
                    "parameters": t["input_schema"],
                    "defer_loading": None,
                },
            }
        ).model_dump()
        for t in body.get("tools", [])
    ]
    return out, tools


def kwargs_of(body: dict[str, Any]) -> dict[str, Any]:
    return dict(body.get("chat_template_kwargs") or {})


# -- the checks -------------------------------------------------------------------------------


def test_responses_count_equals_the_reference_on_generated_requests(
    hf_counter: TokenCounter, reference: Any
) -> None:
    rng = random.Random(15)
    shapes = {"tools": 0, "calls": 0, "cjk": 0, "thinking_off": 0, "thinking_on": 0}
    for _ in range(REQUESTS_PER_ROUTE):
        body = responses_request(rng)
        routed = parse_responses(orjson.dumps(body))
        got = hf_counter.count_sync("qwen3.6", routed.prompt).tokens
        messages, tools = vllm_responses(body)
        want = reference_count(reference, messages, tools, kwargs_of(body))
        assert got == want, body
        raw = json.dumps(body, ensure_ascii=False)
        shapes["tools"] += "tools" in body
        shapes["calls"] += "function_call_output" in raw
        shapes["cjk"] += "中文" in raw or "東京" in raw
        flag = kwargs_of(body).get("enable_thinking")
        shapes["thinking_off"] += flag is False
        shapes["thinking_on"] += flag is True
    assert all(n >= 5 for n in shapes.values()), shapes


def test_messages_count_equals_the_reference_on_generated_requests(
    hf_counter: TokenCounter, reference: Any
) -> None:
    rng = random.Random(16)
    shapes = {"tools": 0, "tool_results": 0, "multi_turn": 0, "thinking_off": 0, "cjk": 0}
    for _ in range(REQUESTS_PER_ROUTE):
        body = messages_request(rng)
        routed = parse_messages(orjson.dumps(body))
        got = hf_counter.count_sync("qwen3.6", routed.prompt).tokens
        messages, tools = vllm_messages(body)
        want = reference_count(reference, messages, tools, kwargs_of(body))
        assert got == want, body
        raw = json.dumps(body, ensure_ascii=False)
        shapes["tools"] += "tools" in body
        shapes["tool_results"] += "tool_result" in raw
        shapes["multi_turn"] += len(body["messages"]) > 1
        shapes["thinking_off"] += kwargs_of(body).get("enable_thinking") is False
        shapes["cjk"] += "中文" in raw or "東京" in raw
    assert all(n >= 5 for n in shapes.values()), shapes


def test_embeddings_count_is_the_sum_of_inputs_as_the_reference_tokenizes_them(
    hf_counter: TokenCounter, reference: Any
) -> None:
    """vLLM's usage.prompt_tokens for a batch is the sum of its inputs (each prefilled); the
    largest single input is kept apart, for context fit."""
    rng = random.Random(17)
    for _ in range(REQUESTS_PER_ROUTE):
        inputs = [text(rng) * rng.randint(1, 5) for _ in range(rng.randint(1, 6))]
        body = {"model": "qwen3.6", "input": inputs[0] if len(inputs) == 1 else inputs}
        routed = parse_pooling("embeddings", orjson.dumps(body))
        got = hf_counter.count_sync("qwen3.6", routed.prompt)
        sizes = [len(reference(t)["input_ids"]) for t in inputs]
        assert (got.tokens, got.longest) == (sum(sizes), max(sizes)), body


def test_chat_options_change_the_count_as_the_template_says(
    hf_counter: TokenCounter, reference: Any
) -> None:
    """enable_thinking, add_generation_prompt and continue_final_message on chat, against the
    reference; tools dumped as vLLM does (a null description is real tokens)."""
    from gateway.protocols.openai import parse_request

    messages = [
        {"role": "user", "content": "东京 weather?"},
        {"role": "assistant", "content": "Let me check"},
    ]
    tool = {"type": "function", "function": {"name": "get", "parameters": schema(random.Random(1))}}
    cases: list[tuple[dict[str, Any], bool]] = [
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"chat_template_kwargs": {"enable_thinking": True}}, False),
        ({"add_generation_prompt": False, "continue_final_message": True}, True),
    ]
    counts = set()
    for extra, continue_final in cases:
        body = {"model": "qwen3.6", "messages": messages, "tools": [tool], **extra}
        got = hf_counter.count_sync("qwen3.6", parse_request("chat", orjson.dumps(body)).prompt)
        tools = [ToolParam.model_validate(tool).model_dump()]
        want = reference_count(
            reference, messages, tools, kwargs_of(body), continue_final=continue_final
        )
        assert got.tokens == want, extra
        counts.add(got.tokens)
    assert len(counts) == 3  # each option changed the prompt


def test_reference_folder_is_the_shipped_one() -> None:
    assert Path(DATA / "chat_template.jinja").is_file()
