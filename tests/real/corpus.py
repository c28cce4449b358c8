"""The varied requests whose prompt the gateway must count exactly as vLLM does.

``CORPUS`` is a list of ``Case``: a category (one test per category in test_exact_count.py), an
id, the API route and the request body (``max_tokens`` small: the counts are the point). Every
body is what a real client sends; none is shaped to suit the gateway.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MODEL = "qwen3.6"
Route = str  # "chat" | "completions" | "responses" | "messages"


@dataclass(frozen=True)
class Case:
    category: str
    id: str
    route: Route
    body: dict[str, Any]


def _chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": list(messages), "max_tokens": 1, **extra}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def system(content: Any) -> dict[str, Any]:
    return {"role": "system", "content": content}


def assistant(content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **extra}


def parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


PROSE = (
    "The lighthouse keeper wrote every evening in a ledger bound with string, noting the wind, "
    "the ships that passed and the colour of the sea at dusk. Nobody read it until the light "
    "was automated, and then a clerk found forty years of weather in a cupboard."
)
CODE = '''def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
'''
JSON_DOC = json.dumps(
    {
        "order": 81724,
        "items": [
            {"sku": f"A-{i:04d}", "qty": i % 7, "price": round(i * 1.37, 2)} for i in range(12)
        ],
        "ship_to": {"name": "Zoë Ångström", "city": "Malmö", "zip": "211 22"},
        "flags": [True, False, None],
    }
)
CJK = "東京の天気は晴れです。明日は雨が降るでしょう。北京今天多云，气温二十度。서울은 맑습니다."  # noqa: RUF001
MIXED = "naïve café — ﬁne 🚀🔥 क़ Ελληνικά Кириллица e\u0301 \u200b zero-width"
BILLING = "x-anthropic-billing-header: cc_version=2.1.3.a1b; cc_entrypoint=cli; cch=8f3a2b1c9d;"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Full-text search over the manual.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})},
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _cases() -> list[Case]:
    out: list[Case] = []

    def add(category: str, id_: str, body: dict[str, Any], route: Route = "chat") -> None:
        out.append(Case(category, id_, route, body))

    # Plain chat.
    add("plain", "hello", _chat(user("hello")))
    add("plain", "prose", _chat(user(PROSE)))
    add("plain", "one-char", _chat(user("?")))
    add("plain", "empty", _chat(user("")))
    add("plain", "whitespace", _chat(user("  leading and trailing  \n\n")))
    add("plain", "mixed-unicode", _chat(user(MIXED)))
    add("plain", "special-token-text", _chat(user("literal <|im_start|> and <|im_end|> text")))
    # System prompts.
    add("system", "short", _chat(system("You are terse."), user("hello")))
    add("system", "long", _chat(system(PROSE), user("Summarise the above.")))
    add("system", "empty-system", _chat(system(""), user("hi")))
    add(
        "system",
        "system-then-turns",
        _chat(system("Be kind."), user("a"), assistant("b"), user("c")),
    )
    add("system", "newlines", _chat(system("line one\nline two\n\nline four"), user("ok")))
    # Content given as a list of text parts (defect 1: vLLM concatenates them).
    add("content_parts", "user-two", _chat(user(parts("Hello", "world"))))
    add("content_parts", "user-three", _chat(user(parts("one ", "two ", "three"))))
    add("content_parts", "system-parts", _chat(system(parts("Be brief.", "Be kind.")), user("hi")))
    add("content_parts", "single-part", _chat(user(parts(PROSE))))
    add(
        "content_parts",
        "assistant-parts",
        _chat(user("q"), assistant(parts("first", "second")), user("again")),
    )
    # The developer role (defect 2: vLLM maps it to system).
    add(
        "developer",
        "alone",
        _chat({"role": "developer", "content": "Answer in French."}, user("hi")),
    )
    add(
        "developer",
        "parts",
        _chat({"role": "developer", "content": parts("Rule 1.", "Rule 2.")}, user("hi")),
    )
    add(
        "developer",
        "multi-turn",
        _chat({"role": "developer", "content": "Short."}, user("a"), assistant("b"), user("c")),
    )
    # Multi-turn conversations.
    turns = [
        user("What is 2+2?"),
        assistant("4."),
        user("And times 3?"),
        assistant("12."),
        user("ok"),
    ]
    add("multi_turn", "five", _chat(*turns))
    add("multi_turn", "with-system", _chat(system("Maths tutor."), *turns))
    add("multi_turn", "long-history", _chat(*[m for _ in range(6) for m in turns[:4]], user("end")))
    add("multi_turn", "assistant-last", _chat(user("hi"), assistant("hello")))
    add("multi_turn", "prose-turns", _chat(user(PROSE), assistant(PROSE[:120]), user(PROSE[120:])))
    # Tools and tool calls.
    add("tools", "one-tool", _chat(user("Weather in Paris?"), tools=[WEATHER_TOOL]))
    add("tools", "two-tools", _chat(user("Find docs"), tools=[WEATHER_TOOL, SEARCH_TOOL]))
    add(
        "tools",
        "tool-choice-none",
        _chat(user("hi"), tools=[WEATHER_TOOL], tool_choice="none"),
    )
    add(
        "tools",
        "call-and-result",
        _chat(
            user("Weather in Paris?"),
            assistant(None, tool_calls=[CALL]),
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
            tools=[WEATHER_TOOL],
        ),
    )
    add(
        "tools",
        "call-with-text",
        _chat(
            system("Use tools."),
            user("Weather in Paris and Rome?"),
            assistant("Checking.", tool_calls=[CALL]),
            {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
            user("thanks"),
            tools=[WEATHER_TOOL, SEARCH_TOOL],
        ),
    )
    add(
        "tools",
        "two-results",
        _chat(
            user("Both cities"),
            assistant(None, tool_calls=[CALL, {**CALL, "id": "call_2"}]),
            {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "18C"},
            tools=[WEATHER_TOOL],
        ),
    )
    # CJK, code and JSON.
    add("cjk", "japanese-chinese-korean", _chat(user(CJK)))
    add("cjk", "system-cjk", _chat(system("请用中文回答。"), user(CJK)))
    add("cjk", "cjk-x4", _chat(user(CJK * 4)))
    add("cjk", "fullwidth", _chat(user("ＡＢＣ１２３　ｶﾀｶﾅ")))  # noqa: RUF001
    add("code", "python", _chat(user(f"Review:\n```python\n{CODE}```")))
    add("code", "system-code", _chat(system("You review code."), user(CODE)))
    add("code", "tabs", _chat(user("if x:\n\tif y:\n\t\treturn 1\n")))
    add("code", "code-x3", _chat(user(CODE * 3)))
    add("json", "doc", _chat(user(JSON_DOC)))
    add("json", "pretty", _chat(user(json.dumps(json.loads(JSON_DOC), indent=2))))
    add("json", "in-system", _chat(system(f"Schema: {JSON_DOC}"), user("validate")))
    add(
        "json", "response-format", _chat(user("Give JSON"), response_format={"type": "json_object"})
    )
    # Thinking on and off, and thinking history.
    add("thinking", "off", _chat(user("hello"), **NO_THINKING))
    add("thinking", "on", _chat(user("hello"), chat_template_kwargs={"enable_thinking": True}))
    add("thinking", "off-system", _chat(system("Terse."), user(PROSE), **NO_THINKING))
    add(
        "thinking",
        "off-multi-turn",
        _chat(user("a"), assistant("b"), user("c"), **NO_THINKING),
    )
    add(
        "thinking",
        "history-think-tags",
        _chat(user("2+2?"), assistant("<think>\nadd them\n</think>\n\n4"), user("and 3+3?")),
    )
    add(
        "thinking",
        "history-reasoning-field",
        _chat(user("2+2?"), assistant("4", reasoning="add them"), user("and 3+3?")),
    )
    add("thinking", "off-tools", _chat(user("Weather?"), tools=[WEATHER_TOOL], **NO_THINKING))
    # continue_final_message: the last assistant message is continued, no generation prompt.
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    add("continue_final", "prefix", _chat(user("Write a haiku"), assistant("Autumn moon"), **cont))
    add(
        "continue_final",
        "with-system",
        _chat(system("Poet."), user("Write"), assistant("The sea,"), **cont),
    )
    add(
        "continue_final",
        "no-thinking",
        _chat(user("List"), assistant("1."), **cont, **NO_THINKING),
    )
    # A Claude Code billing header as the first line of a system message (defect 8).
    add("billing_header", "line", _chat(system(f"{BILLING}\nYou are Claude Code."), user("hi")))
    add(
        "billing_header",
        "parts",
        _chat(system(parts(BILLING, "You are Claude Code.")), user("hi")),
    )
    add("billing_header", "alone", _chat(system(BILLING), user("hi")))
    # Completions: one prompt, and a batch (defect 3: usage is the sum).
    completion = {"model": MODEL, "max_tokens": 1}
    add("completions", "prose", {**completion, "prompt": PROSE}, "completions")
    add("completions", "code", {**completion, "prompt": CODE}, "completions")
    add("completions", "cjk", {**completion, "prompt": CJK}, "completions")
    add("completions", "json", {**completion, "prompt": JSON_DOC}, "completions")
    add("batched", "two", {**completion, "prompt": ["hello world", "a b c d"]}, "completions")
    add("batched", "three", {**completion, "prompt": [PROSE, CODE, CJK]}, "completions")
    add("batched", "one-in-list", {**completion, "prompt": [PROSE]}, "completions")
    add("batched", "token-ids", {**completion, "prompt": [[14556, 1814], [14556]]}, "completions")
    # The Responses and Messages APIs.
    resp = {"model": MODEL, "max_output_tokens": 16}
    add("responses", "string", {**resp, "input": "hello"}, "responses")
    add(
        "responses",
        "instructions",
        {**resp, "instructions": "Be terse.", "input": [{"role": "user", "content": PROSE}]},
        "responses",
    )
    msgs = {"model": MODEL, "max_tokens": 1}
    add("messages", "plain", {**msgs, "messages": [user("hello")]}, "messages")
    add(
        "messages", "system", {**msgs, "system": "Be terse.", "messages": [user(PROSE)]}, "messages"
    )
    add(
        "messages",
        "billing-block",
        {
            **msgs,
            "system": [{"type": "text", "text": BILLING}, {"type": "text", "text": "You are CC."}],
            "messages": [user([{"type": "text", "text": "hi"}])],
        },
        "messages",
    )
    return out


CORPUS = _cases()
CATEGORIES = sorted({c.category for c in CORPUS})
