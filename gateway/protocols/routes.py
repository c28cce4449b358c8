"""Every engine route the gateway proxies: one table, path -> how to parse and answer it.

The upstream path is the client's path (vLLM serves each route under the same name), so the
table is also the one endpoint -> upstream path map. Every route here runs the whole pipeline
(count, lane, slot, watchdogs, release on disconnect, decision log):

    path                                   endpoint        prompt counted as            errors
    /v1/chat/completions                   chat            chat template                openai
    /v1/completions                        completions     sum of the prompts           openai
    /v1/responses                          responses       chat template (vLLM's        openai
                                                           conversion of the items)
    /v1/messages                           messages        chat template (vLLM's        anthropic
                                                           conversion of the blocks)
    /v1/embeddings, /pooling               embeddings ...  sum of the inputs (or chat)  openai
    /v1/score, /score                      score           sum of the pairs             openai
    /v1/rerank, /rerank, /v2/rerank        rerank          sum of query+document pairs  openai
    /tokenize, /detokenize                 tokenize ...    its prompt / its token ids   openai
    /v1/audio/transcriptions, .../translations  (multipart) not counted: routes.multipart_lane

/tokenize and /detokenize take a slot in the lane their count chooses, like any other request:
they are short CPU work in the engine's API server, and a path that skips admission would be a
way around every limit (and around the release guarantees) for whoever calls it in a loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine_pool.engine_api import RouteKind
from gateway.core.exchange import JSON
from gateway.errors import ErrorShape
from gateway.protocols.messages import parse_messages
from gateway.protocols.openai import RoutedRequest, parse_request
from gateway.protocols.pooling import parse_pooling
from gateway.protocols.responses import parse_responses

MULTIPART = frozenset({"multipart/form-data"})


@dataclass(frozen=True, slots=True)
class EngineRoute:
    kind: RouteKind
    path: str
    # None for multipart routes: no text to count, only the model field is read.
    parse: Callable[[bytes], RoutedRequest] | None
    errors: ErrorShape = "openai"

    @property
    def multipart(self) -> bool:
        return self.parse is None

    @property
    def media_types(self) -> frozenset[str]:
        """The Content-Types the route accepts (415 otherwise), as vLLM's server does."""
        return MULTIPART if self.multipart else JSON


def _pooling(kind: RouteKind) -> Callable[[bytes], RoutedRequest]:
    return lambda body: parse_pooling(kind, body)


def _openai(kind: RouteKind) -> Callable[[bytes], RoutedRequest]:
    return lambda body: parse_request(kind, body)


_ROUTES = (
    EngineRoute("chat", "/v1/chat/completions", _openai("chat")),
    EngineRoute("completions", "/v1/completions", _openai("completions")),
    EngineRoute("responses", "/v1/responses", parse_responses, "responses"),
    EngineRoute("messages", "/v1/messages", parse_messages, "anthropic"),
    EngineRoute("embeddings", "/v1/embeddings", _pooling("embeddings")),
    EngineRoute("pooling", "/pooling", _pooling("pooling")),
    EngineRoute("score", "/v1/score", _pooling("score")),
    EngineRoute("score", "/score", _pooling("score")),
    EngineRoute("rerank", "/v1/rerank", _pooling("rerank")),
    EngineRoute("rerank", "/rerank", _pooling("rerank")),
    EngineRoute("rerank", "/v2/rerank", _pooling("rerank")),
    EngineRoute("tokenize", "/tokenize", _pooling("tokenize")),
    EngineRoute("detokenize", "/detokenize", _pooling("detokenize")),
    EngineRoute("transcriptions", "/v1/audio/transcriptions", None),
    EngineRoute("translations", "/v1/audio/translations", None),
)

ENGINE_ROUTES: dict[str, EngineRoute] = {route.path: route for route in _ROUTES}


def path_of(kind: RouteKind) -> str:
    """The path a route kind is served under (its first route in the table)."""
    return next(route.path for route in _ROUTES if route.kind == kind)
