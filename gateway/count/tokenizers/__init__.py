"""Helpers behind ``gateway.count.tokens``: encoders, vocabulary loading, chat templates, the
count cache.

``gateway.count.tokens`` is the public interface; nothing outside it should import from here except
tests and benchmarks that compare backends.

    encoders.py   one ``Encoder`` protocol over gigatoken, tiktoken and Hugging Face tokenizers
    sources.py    ``load_vocabulary(TokenizerSettings)``: shipped files, local files, fallbacks
    vocab.py      ``Vocabulary``: the warmed encoder and what counting knows about it
    hf_json.py    a tokenizer.json and the chat template beside it
    tiktoken_files.py  .tiktoken files and tiktoken's named encodings
    backends.py   which backend serves a vocabulary, in a child process or this one
    worker.py     ``ChildEncoder``: the tokenizer in a child process (child.py), recycled on RSS
    processes.py  the template process and the counting children forked from it
    templates.py  what the engine sees: built-in ChatML pieces, or a model's Jinja chat template
    cache.py      the bounded LRU of per-piece counts
"""
