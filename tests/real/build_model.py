"""Build the real tier's tiny Qwen2 model with random weights, offline, into a folder.

    REAL_VLLM_PYTHON tests/real/build_model.py OUT_DIR

Run by the vLLM venv's python (it has torch and transformers). Nothing is downloaded: the
tokenizer, its config and the chat template are the files shapegate ships for Qwen3.6
(gateway/count/tokenizer_data/qwen3.6), so vLLM tokenizes and templates exactly as the real
model would, while the weights are random: the text is garbage, the wire, the scheduler and
the counts are real. Prints OUT_DIR when done.
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHIPPED = Path(__file__).resolve().parents[2] / "gateway" / "count" / "tokenizer_data" / "qwen3.6"
# The tokenizer has 248,077 ids; the embedding table must cover every one of them.
VOCAB_SIZE = 248_320


def build(out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(SHIPPED / "tokenizer.json.zip") as archive:
        (out / "tokenizer.json").write_bytes(archive.read("tokenizer.json"))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(SHIPPED / name, out / name)
    config = Qwen2Config(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=8192,
        # The template closes each turn with <|im_end|>: the model's own end of sequence.
        eos_token_id=248046,
        bos_token_id=None,
        pad_token_id=248044,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build_model.py OUT_DIR")
    print(build(Path(sys.argv[1])))
