"""Each model's counting setup, loaded from the settings at start-up: its vocabulary (one loaded
tokenizer shared by the models that name the same files) and the chat template its prompts are
rendered with.

Contract: ``load_models(settings, metrics)`` loads and warms every model's tokenizer (never from
the network; ``tokenizers/sources.py``) and logs ``tokenizer.loaded`` once a model, with the
backend in use and any fallback (each fallback logged and counted as swallowed); a file that
fails to load, or ``chat_template: hf`` with no template beside the tokenizer or one that does
not compile, is a ``ConfigError`` naming the model. ``chat_template: auto`` resolves to ``hf``
when the tokenizer ships a template, else ``chatml``. It answers the models by name and alias,
and the tokens each loaded vocabulary's warm-up should count (``tokenizers/warmup.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from jinja2 import TemplateError

from gateway.count.plan import Model
from gateway.count.tokenizers import warmup
from gateway.count.tokenizers.backends import EncoderLimits
from gateway.count.tokenizers.sources import load_vocabulary
from gateway.count.tokenizers.templates import ChatTemplate
from gateway.count.tokenizers.vocab import Vocabulary
from gateway.observe.log import Logger, get_logger, swallowed
from gateway.observe.metrics import Metrics
from gateway.settings import ConfigError, Settings


def load_models(
    settings: Settings, metrics: Metrics | None = None
) -> tuple[dict[str, Model], dict[str, int]]:
    """Every model by name and alias, and the first model of each vocabulary with the tokens
    its warm-up counts."""
    log = get_logger("tokens")
    loaded: dict[str, Vocabulary] = {}
    models: dict[str, Model] = {}
    warm: dict[str, int] = {}  # first model of each vocabulary -> warm-up tokens
    for index, model in enumerate(settings.models):
        spec = model.tokenizer
        key = ("models", index, "tokenizer")
        started = time.perf_counter()
        # Models sharing a vocabulary share one loaded tokenizer (~120 MB for Qwen's).
        shared = spec.model_dump_json(exclude={"chat_template"})
        vocab = loaded.get(shared)
        if vocab is None:
            try:
                tokens = warmup.warm_tokens(settings, model.max_model_len)
                vocab = load_vocabulary(
                    spec,
                    _fallback_logger(log, metrics, model.name),
                    EncoderLimits(
                        settings.counting.max_encoder_rss_mb,
                        metrics,
                        warm_chars=int(tokens * warmup.CHARS_PER_TOKEN),
                    ),
                )
            except ConfigError as exc:
                raise ConfigError(f"model {model.name!r}: {exc}", key) from exc
            loaded[shared] = vocab
            warm[model.name] = tokens
        template = None
        mode = spec.chat_template
        if mode == "auto":
            mode = "chatml" if vocab.chat_template is None else "hf"
        if mode == "hf":
            if vocab.chat_template is None:
                raise ConfigError(
                    f"model {model.name!r}: chat_template hf, but no chat template "
                    f"(chat_template.jinja, or chat_template in tokenizer_config.json) "
                    f"ships beside {vocab.origin}",
                    (*key, "chat_template"),
                )
            try:
                template = ChatTemplate(vocab.chat_template, vocab.template_vars)
            except TemplateError as exc:
                raise ConfigError(
                    f"model {model.name!r}: the chat template beside "
                    f"{vocab.origin} does not compile: {exc}",
                    (*key, "chat_template"),
                ) from exc
        entry = Model(vocab, mode, template)
        for name in (model.name, *model.aliases):
            models[name] = entry
        log.info(
            "tokenizer.loaded",
            model=model.name,
            tokenizer=vocab.id,
            backend=vocab.encoder.backend,
            fallback=vocab.fallback,
            origin=vocab.origin,
            chat_template=mode,
            bound="sound" if vocab.bound_sound else "disabled",
            piece_cache=vocab.split_token is not None,
            load_ms=round((time.perf_counter() - started) * 1000, 1),
        )
    return models, warm


def _fallback_logger(
    log: Logger,
    metrics: Metrics | None,
    model: str,
) -> Callable[[str, BaseException, str], None]:
    def record(backend: str, exc: BaseException, decision: str) -> None:
        swallowed(log, metrics, "tokenizer.load", exc, decision, model=model, backend=backend)

    return record
