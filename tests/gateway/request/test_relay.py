"""The relay of a stream that may migrate (gateway/request/relay.py): whole events passed on and
an error held back, the token ids collected and blanked, a continuation spliced into the first
stream (its id, no second role, the whole answer's usage; a completions stream re-shaped into
chat chunks), a replay's first tokens checked and dropped. Pure."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.request.migration import SoFar, continuation
from gateway.request.relay import Relay

IDS = SoFar(" lorem ipsum", 2, True, False, None, [7, 8, 9], [1000, 1001])


def sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chunk(text: str, *, id_: str = "chatcmpl-a", role: bool = False, **extra: Any) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return sse({"id": id_, "object": "chat.completion.chunk", "created": 1, "choices": [choice]})


def with_ids(text: str, ids: list[int] | None, prompt: list[int] | None = None) -> bytes:
    """A chat chunk as vLLM 0.32 sends it when asked for the token ids."""
    if prompt is not None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return sse(
            {"id": "chatcmpl-a", "created": 1, "choices": [choice], "prompt_token_ids": prompt}
        )
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None, "token_ids": ids}
    return sse({"id": "chatcmpl-a", "created": 1, "choices": [choice]})


def test_the_relay_collects_the_token_ids_and_blanks_them_unless_the_client_asked() -> None:
    first = with_ids("", None, [7, 8, 9]) + with_ids(" lorem", [1000]) + with_ids(" ipsum", [1001])
    relay = Relay("chat", collect_ids=True, strip_ids=True)
    out = relay.feed(first)
    assert b"[" not in out.replace(b'"choices":[', b"")  # no id list reaches the client
    assert out.count(b'token_ids":null') == 3
    assert relay.so_far() == IDS
    mine = Relay("chat", collect_ids=True, strip_ids=False)
    assert mine.feed(first) == first and mine.so_far() == IDS
    # One event without its ids (hidden reasoning, an older vLLM): the text it is.
    gap = Relay("chat", collect_ids=True, strip_ids=True)
    gap.feed(first + with_ids(" dolor", None))
    assert gap.so_far().ids is None


def test_a_completion_continuing_a_chat_answer_is_reshaped_into_its_chunks() -> None:
    relay = Relay("chat", collect_ids=True, strip_ids=True)
    relay.feed(with_ids("", None, [7, 8]) + with_ids(" lorem", [1000]) + with_ids(" ipsum", [1001]))
    relay.spliced(prompt_tokens=None, by="token_ids")
    head = {"id": "cmpl-b", "object": "text_completion", "created": 9, "model": "m"}
    choice = {
        "index": 0,
        "text": " dolor",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_token_ids": [7, 8, 1000, 1001],
        "token_ids": [1002],
    }
    usage = {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1}
    out = relay.feed(
        sse({**head, "choices": [choice]})
        + sse({**head, "choices": [], "usage": usage})
        + b"data: [DONE]\n\n"
    )
    events = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert events[0] == {
        "id": "chatcmpl-a",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": " dolor"},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
            }
        ],
    }
    # The prompt's tokens are the original prompt's (its ids' count), the answer's all three.
    assert events[1]["usage"] == {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3}
    assert relay.so_far().ids == [1000, 1001, 1002]


def test_an_answer_cut_early_enough_is_replayed_and_its_first_tokens_checked() -> None:
    data = {"messages": [], "max_tokens": 10, "stream": True}
    assert continuation("chat", data, IDS, 100, None, 1) == continuation("chat", data, IDS, 100)
    replay = continuation("chat", data, IDS, 100, None, 2)
    assert (orjson.loads(replay.body), replay.path, replay.by) == (data, None, "replay")
    assert continuation("chat", data, IDS, 100, "tools", 3).by == "text:tools"
    first = with_ids("", None, [7, 8, 9]) + with_ids(" lorem", [1000]) + with_ids(" ipsum", [1001])
    for later, diverged in (([1000, 1001, 1002], False), ([1000, 1005, 1002], True)):
        relay = Relay("chat", collect_ids=True, strip_ids=True)
        relay.feed(first)
        relay.spliced(None, "replay")
        again = with_ids("", None, [7, 8, 9]) + b"".join(
            with_ids(w, [i]) for w, i in zip((" lorem", " ipsum", " dolor"), later, strict=True)
        )
        out = relay.feed(again)
        assert relay.diverged is diverged
        # Repeated: dropped; then the rest spliced. Diverged: nothing from that point on.
        assert out == (b"" if diverged else with_ids(" dolor", None))
        assert relay.so_far().text == (" lorem ipsum" if diverged else " lorem ipsum dolor")


def test_the_relay_passes_whole_events_and_holds_back_an_error() -> None:
    relay = Relay("chat")
    first = chunk("", role=True) + chunk(" lorem")
    assert relay.feed(first[:-10]) == chunk("", role=True)  # the cut event waits
    assert relay.feed(first[-10:] + chunk(" ipsum")[:5]) == chunk(" lorem")
    error = sse({"error": {"message": "dead", "code": 500}}) + b"data: [DONE]\n\n"
    assert relay.feed(chunk(" ipsum")[5:] + error) == chunk(" ipsum")
    assert relay.failure
    assert relay.so_far() == SoFar(" lorem ipsum", 2, True, False, None)


def test_a_spliced_stream_is_the_first_ones_id_without_a_second_role_and_whole_usage() -> None:
    relay = Relay("chat")
    relay.feed(chunk("", role=True) + chunk(" lorem") + chunk(" ipsum"))
    relay.spliced(prompt_tokens=11)
    usage = {"prompt_tokens": 13, "total_tokens": 14, "completion_tokens": 1}
    second = (
        chunk("", id_="chatcmpl-b", role=True)
        + chunk(" dolor", id_="chatcmpl-b")
        + sse({"id": "chatcmpl-b", "created": 9, "choices": [], "usage": usage})
        + b"data: [DONE]\n\n"
    )
    out = relay.feed(second)
    events = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert [e["id"] for e in events] == ["chatcmpl-a", "chatcmpl-a"]
    assert [e["created"] for e in events] == [1, 1]
    assert events[0]["choices"][0]["delta"] == {"content": " dolor"}
    assert events[1]["usage"] == {"prompt_tokens": 11, "total_tokens": 14, "completion_tokens": 3}
    assert out.endswith(b"data: [DONE]\n\n")
    assert relay.so_far().text == " lorem ipsum dolor" and relay.migrations == 1
