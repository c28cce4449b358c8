"""The record (gateway/observe/record.py) as plain data: never the prompt's text, one JSON
shape for every record."""

from __future__ import annotations

import orjson

from gateway.core.decision import Decision
from gateway.count.tokens import TokenCounter
from gateway.edge.admin.state import decision_row
from gateway.errors import BadRequest
from gateway.observe.record import Record, Routed
from gateway.protocols.openai import parse_request
from tests.gateway.observe.test_recorder import recorder, routed


def test_a_record_never_holds_prompt_text(counter: TokenCounter) -> None:
    body = orjson.dumps({"model": "qwen3.6", "messages": [{"role": "user", "content": "canary"}]})
    request = parse_request("chat", body)
    bound = counter.count_sync("qwen3.6", request.prompt, exact_above=2000)
    assert bound.plan is not None  # what the exact count is finished from, later
    decision = Decision(lane=None, clusters=(), reason="no_lane")
    kept = Routed.of(request, bound, decision, {})
    assert kept.count.plan is None and kept.count.tokens == bound.tokens
    assert "canary" not in repr(kept)


def test_every_record_has_the_same_json_shape_for_the_dashboard() -> None:
    rec = recorder()
    unparsed, routed_ = Record("r1", "chat"), Record("r2", "chat")
    rec.decided(routed_, routed())
    rec.refused(unparsed, BadRequest("bad json"))
    assert tuple(routed().log_fields()) == Routed.FIELDS
    assert unparsed.as_json().keys() == routed_.as_json().keys()
    rows = [decision_row(r, wall_now=1e9, mono_now=r.started + 1) for r in (unparsed, routed_)]
    assert rows[0]["model"] is None and rows[0]["error"] == "bad json"
    assert rows[0]["outcome"] == "in_flight" and rows[1]["lane"] == "fast"  # neither finished
