"""The pause rule (engine_pool/pause.py): which reads a cached question pauses."""

from __future__ import annotations

from engine_pool.pause import InFlight, PauseRule, Question, is_question, to_pause

RULE = PauseRule(question_max_tokens=8192, read_min_tokens=32768, max_pauses=3)
QUESTION = Question(uncached=2000, head=1)


def read(key: str, remaining: int = 200_000, head: int | None = 2, **rest: object) -> InFlight:
    fields: dict[str, object] = {"started": False, "pauses": 0, "pausing": False, **rest}
    return InFlight(key, remaining, head, **fields)  # type: ignore[arg-type]


def test_a_cached_question_pauses_another_documents_long_read() -> None:
    assert to_pause(QUESTION, [read("r")], RULE) == ["r"]


def test_a_question_with_much_uncached_pauses_nothing() -> None:
    assert is_question(Question(8192, 1), RULE) and not is_question(Question(8193, 1), RULE)
    assert to_pause(Question(8193, 1), [read("r")], RULE) == []


def test_each_limit_keeps_a_request_running() -> None:
    kept = [
        read("short", remaining=32768),  # not more than read_min_tokens left
        read("answering", started=True),  # its first token is out
        read("own", head=1),  # the question's own document
        read("asker", pausing=True),  # a question that paused others
        read("tired", pauses=3),  # max_pauses reached
    ]
    assert to_pause(QUESTION, kept, RULE) == []
    # A read of yet another document is paused; the others share no block with it.
    assert to_pause(QUESTION, [*kept, read("r", remaining=32769, head=9)], RULE) == ["r"]


def test_a_request_waiting_on_a_paused_reads_blocks_is_paused_with_it() -> None:
    """The partner was sent believing the read's document cached (little left), but would read
    the rest of it itself once the read stops; another document's short request is left."""
    partner = read("partner", remaining=300)
    other = read("other", remaining=300, head=7)
    answered = read("answered", remaining=300, started=True)
    assert to_pause(QUESTION, [read("r"), partner, other, answered], RULE) == ["r", "partner"]
    # No read paused: the partner alone is not.
    assert to_pause(QUESTION, [partner], RULE) == []


def test_a_read_without_a_whole_block_has_no_partners() -> None:
    assert to_pause(QUESTION, [read("r", head=None), read("p", 300, head=None)], RULE) == ["r"]
