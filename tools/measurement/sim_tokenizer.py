"""A Hugging Face tokenizer that tokenizes exactly as narwhal-sim does, installed into an
``HF_HOME`` cache as ``org/name`` so clients that insist on a hub name (aiperf with
``HF_HUB_OFFLINE=1`` rejects a plain folder path) can load it with no network.

    sim_tokenizer.py --hf-home DIR [--name narwhal/sim-vocab] [--vocab-seed 0]

The simulator's vocabulary (``narwhal.simengine.vocab``): ids 0-255 are bytes, then 10,000 words
" CVCV" (consonant-vowel-consonant-vowel with a leading space), then three specials. Its encoder
takes " " + four letters as one token when that is a vocabulary word and falls back to bytes
otherwise; a pre-tokenizer that isolates exactly the vocabulary words (and single characters
elsewhere) yields the same ids, since a four-letter piece that is not a word contains no space
at which a word could start. Text outside Latin-1 is where the two differ (bytes vs ``<unk>``).

Exit status: 0 written; 2 bad arguments or the ``tokenizers`` package is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from narwhal.simengine.vocab import EOS, IM_END, IM_START, NUM_BYTE_TOKENS, Vocabulary

__all__ = ["build_tokenizer_json", "install", "main"]

PROG = "sim_tokenizer.py"
DEFAULT_NAME = "narwhal/sim-vocab"
_C = "[bcdfghjklmnprstvwxyz]"
_V = "[aeiou]"


def build_tokenizer_json(vocab_seed: int = 0) -> str:
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    v = Vocabulary(vocab_seed)
    ids: dict[str, int] = {chr(b): b for b in range(NUM_BYTE_TOKENS)}
    ids.update({w: NUM_BYTE_TOKENS + i for i, w in enumerate(v.words)})
    ids.update({IM_START: v.im_start_id, IM_END: v.im_end_id, EOS: v.eos_id})
    tok = Tokenizer(WordLevel(ids, unk_token=chr(0)))
    pattern = rf" {_C}{_V}{_C}{_V}|<\|im_start\|>|<\|im_end\|>|<\|eos\|>|[\s\S]"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens carry their own spaces
    tok.add_special_tokens([IM_START, IM_END, EOS])
    return tok.to_str()


def install(hf_home: Path, name: str = DEFAULT_NAME, vocab_seed: int = 0) -> Path:
    """Write the tokenizer as the hub cache would hold it; return the snapshot directory."""
    if name.count("/") != 1:
        raise ValueError(f"name must be org/name, not {name!r}")
    files = {
        "tokenizer.json": build_tokenizer_json(vocab_seed),
        "tokenizer_config.json": json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "model_max_length": 1 << 20,
                "clean_up_tokenization_spaces": False,
            }
        ),
        # transformers reads a model config before the tokenizer config; an empty one will do.
        "config.json": "{}",
    }
    # The snapshot "commit" is the content hash, so a rebuild with another seed is another one.
    digest = hashlib.sha1("".join(files.values()).encode()).hexdigest()
    repo = hf_home / "hub" / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / digest
    snapshot.mkdir(parents=True, exist_ok=True)
    for fname, text in files.items():
        (snapshot / fname).write_text(text, encoding="utf-8")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(digest)
    return snapshot


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-home", required=True, help="HF_HOME directory to install the tokenizer in")
    p.add_argument(
        "--name",
        default=DEFAULT_NAME,
        help="hub name (org/name) to install it as (default %(default)s)",
    )
    p.add_argument(
        "--vocab-seed",
        type=int,
        default=0,
        help="narwhal-sim's vocabulary seed to mirror (default %(default)s)",
    )
    args = p.parse_args(argv)
    try:
        snapshot = install(Path(args.hf_home), args.name, args.vocab_seed)
    except ImportError:
        print(f"{PROG}: the 'tokenizers' package is not installed", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    print(f"{PROG}: {args.name} -> {snapshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
