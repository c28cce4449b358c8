"""The boot rehearsal of a monster burst: the first burst after readiness as fast as the tenth.

Why: the tokenizer's warm-up (``TokenCounter.warm_up``) counted one large text, serially; the
first burst of concurrent monsters still paid first-time costs on every path it took that the
warm-up had not (issue 31): the gateway's heap grown anew for each buffer of megabytes (6,000-7,500
page faults on the first burst of 4 x 237k tokens, measured), the counting thread's hand-off under
contention, the pipe to the tokenizer child carrying several prompts in a row. So before the
gateway reports ready, ``rehearse`` sends ``burst`` prompts at once through the path a request
takes, minus the sockets and the engine:

1. **receive**: each body is read by ``read_body`` from 64 KiB ASGI messages, as uvicorn hands
   them over;
2. **parse**: the chat route's own parser (``routes.ENGINE_ROUTES``);
3. **count**: ``TokenCounter.count`` with the policy's ``exact_above`` (the bound, the cache, the
   counting thread and the tokenizer child process), all ``burst`` counts concurrently on the
   event loop.

Contract: ``burst_of(settings)`` is the number of concurrent prompts the lanes admit at once:
the slots of the lane that admits the longest prompts, at most ``MAX_BURST``; ``rehearse``
sends that many unique prompts of ``tokens`` tokens each (``warmup.warm_tokens``; none when 0)
for the first model of each tokenizer, and logs ``tokenizer.rehearsed`` (model, burst, tokens,
rehearse_ms). The prompts' counts stay in the count cache (``burst`` entries; no request sends
them). A model whose template refuses the prompt is logged as swallowed and not rehearsed.
``app.py`` awaits it in the lifespan, before uvicorn accepts a connection: readiness after it.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from gateway.core.exchange import Message, read_body
from gateway.count.tokenizers import warmup
from gateway.errors import BadRequest
from gateway.observe.log import Logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.protocols.openai import ChatPrompt
from gateway.protocols.routes import ENGINE_ROUTES
from gateway.request.policy import Policy
from gateway.settings import Settings

# More concurrent prompts than this add boot time, not coverage: the counting thread and the
# tokenizer child take them one at a time anyway.
MAX_BURST = 4
# uvicorn hands a body over in reads of up to 64 KiB.
CHUNK_BYTES = 65_536
CHAT = ENGINE_ROUTES["/v1/chat/completions"]


def burst_of(settings: Settings) -> int:
    widest = max(settings.lanes, key=lambda lane: lane.max_prompt_tokens)
    return max(1, min(MAX_BURST, widest.slots.lane))


async def rehearse(policy: Policy, log: Logger, metrics: Metrics | None = None) -> None:
    settings = policy.settings
    burst = burst_of(settings)
    seen: set[str] = set()
    for model in settings.models:
        tokenizer = policy.counter.tokenizer_id(model.name)
        tokens = warmup.warm_tokens(settings, model.max_model_len)
        if tokenizer in seen or tokens <= 0:
            continue
        seen.add(tokenizer)
        started = time.perf_counter()
        try:
            await asyncio.gather(
                *(_one(policy, model.name, tokens, index) for index in range(burst))
            )
        except BadRequest as exc:  # a template that refuses a lone user message
            swallowed(log, metrics, "tokenizer.rehearse", exc, "served_without_rehearsal")
            continue
        log.info(
            "tokenizer.rehearsed",
            model=model.name,
            burst=burst,
            tokens=tokens,
            rehearse_ms=round((time.perf_counter() - started) * 1000, 1),
        )


async def _one(policy: Policy, model: str, tokens: int, index: int) -> int:
    """One rehearsed request: body read, parse, count; its token count."""
    text = warmup.rehearsal_text(int(tokens * warmup.CHARS_PER_TOKEN), index)
    body = orjson.dumps(
        {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    )
    chunks = [body[at : at + CHUNK_BYTES] for at in range(0, len(body), CHUNK_BYTES)]
    del body, text

    async def receive() -> Message:
        chunk = chunks.pop(0)
        await asyncio.sleep(0)  # another request's turn, as between socket reads
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    scope = {"type": "http", "headers": [(b"content-length", str(sum(map(len, chunks))).encode())]}
    server = policy.settings.server
    read = await read_body(scope, receive, server.max_body_bytes, server.body_timeout_s)
    assert CHAT.parse is not None  # the chat route is JSON
    routed = CHAT.parse(read)
    assert isinstance(routed.prompt, ChatPrompt)
    count = await policy.counter.count(model, routed.prompt, exact_above=policy.exact_above)
    return count.tokens
