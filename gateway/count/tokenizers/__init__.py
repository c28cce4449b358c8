"""Helpers behind ``gateway.count.tokens``: encoders, vocabulary loading, chat templates, the
count cache.

``gateway.count.tokens`` is the public interface; nothing outside it should import from here except
tests and benchmarks that compare backends.

    encoders.py   one ``Encoder`` protocol over gigatoken, tiktoken and Hugging Face tokenizers
    vocab.py      ``load_vocabulary(TokenizerSettings)``: shipped files, local files, fallbacks
    templates.py  what the engine sees: built-in ChatML pieces, or a model's Jinja chat template
    cache.py      the bounded LRU of per-piece counts
"""
