"""Create the tiny random Llama that the real-vLLM interop suite serves, entirely offline.

    .venv-vllm/bin/python tools/interop/make_tiny_model.py OUT_DIR

Run with the vLLM virtual environment's Python (it has torch, transformers and tokenizers).
Writes a Hugging Face model directory: ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` (with a chat
template), plus ``narwhal-tiny.json`` describing what was built and from what. Nothing is
fetched from a hub: the weights are random (seeded) and the tokenizer is a byte-level BPE
trained here on this interpreter's own standard-library sources, so the same Python gives the
same model byte for byte. Exits at once when OUT_DIR already holds a finished model.

Two properties make greedy outputs safe to compare exactly, across engines and between streamed
and non-streamed responses:

- the output-embedding rows of the special tokens are zero, so greedy decoding never picks
  EOS (every request generates exactly ``max_tokens``: a prefill leg always ends on its length
  cap and hands over KV, as vLLM requires);
- the rows of tokens that are not whole printable ASCII are zero too, so generated text never
  ends inside a UTF-8 sequence (vLLM's incremental detokenizer holds such bytes back, which
  would make streamed and whole text differ for reasons that have nothing to do with P/D).

A random logit row is positive at its maximum with overwhelming probability, so a zero row is
never the argmax.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The model's shape (issue 12): 2 layers, hidden 128, 4 heads (head_dim 32), vocab ~4,096.
VOCAB_SIZE = 4096
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 4
INTERMEDIATE = 256
MAX_POSITIONS = 2048
SEED = 0
# Large enough that the top two logits are well apart (fp16 noise cannot swap them).
INIT_STD = 0.2
CORPUS_BYTES = 2_000_000

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
DONE = "narwhal-tiny.json"


def corpus() -> tuple[list[str], str]:
    """ASCII lines of the standard library's top-level modules, in name order, ~2 MB."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    size = 0
    digest = hashlib.sha256()
    for path in sorted(stdlib.glob("*.py")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip() or not line.isascii():
                continue
            lines.append(line)
            digest.update(line.encode() + b"\n")
            size += len(line) + 1
        if size >= CORPUS_BYTES:
            break
    return lines, digest.hexdigest()


def train_tokenizer(lines: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def printable_ascii(text: str) -> bool:
    return all(c == "\n" or 32 <= ord(c) < 127 for c in text)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: make_tiny_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    if (out / DONE).exists():
        print(f"tiny model already in {out}")
        return 0
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    lines, corpus_sha = corpus()
    tok = train_tokenizer(lines)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIALS[2:],
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    vocab = tok.get_vocab_size()

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=[tok.token_to_id(EOS), tok.token_to_id("<|eot_id|>")],
        pad_token_id=tok.token_to_id(EOS),
        torch_dtype="float16",
    )
    model = LlamaForCausalLM(config)
    masked = []
    with torch.no_grad():
        for token_id in range(vocab):
            piece = tok.decode([token_id], skip_special_tokens=False)
            if tok.id_to_token(token_id) in SPECIALS or not printable_ascii(piece):
                masked.append(token_id)
        model.lm_head.weight[masked] = 0.0
    model = model.to(torch.float16)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    info = {
        "layers": LAYERS,
        "hidden_size": HIDDEN,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "vocab_size": vocab,
        "dtype": "float16",
        "seed": SEED,
        "masked_output_tokens": len(masked),
        "corpus": "stdlib *.py ASCII lines",
        "corpus_sha256": corpus_sha,
        "python": sys.version.split()[0],
    }
    (out / DONE).write_text(json.dumps(info, indent=2) + "\n")
    print(f"tiny model in {out}: {json.dumps(info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
