"""Per-route request parsing beyond chat and completions (which live in
``gateway/protocols/openai.py``).

Each module reads one API's routing fields from the raw body and returns a ``RoutedRequest``
whose prompt is what the engine will render: a ``ChatPrompt`` (Responses, Anthropic Messages,
chat-style embeddings and tokenize) or a ``CompletionPrompt`` (embeddings, pooling, score,
rerank, tokenize, detokenize). The body itself is never re-serialised.

    common.py            field readers shared by the parsers (model, stream, integers, arrays)
    template_options.py  add_generation_prompt, continue_final_message, chat_template_kwargs,
                         documents: what changes the rendered prompt besides the messages
    tools.py             tool schemas as vLLM hands them to the chat template
    responses.py         POST /v1/responses -> chat messages, as vLLM converts them
    messages.py          POST /v1/messages (Anthropic) -> chat messages, as vLLM converts them
    pooling.py           embeddings, pooling, score, rerank, tokenize, detokenize
    multipart.py         the ``model`` field of a multipart/form-data body (audio routes)
"""
