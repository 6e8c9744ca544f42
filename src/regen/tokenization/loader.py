"""Loading a model's tokenizer, and the digest that says whether it is still the same one.

The tokenize job loads it in every worker; the prompts job loads it to count prompt tokens and records its
digest, so a prompt set is recounted when the model's tokenizer changes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from regen.errors import JobError

# What a tokenizer is, for its digest: every file that changes how text becomes ids, the chat template
# included (a template edit changes every rendered sample).
DIGESTED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
)


def tokenizer_digest(model_dir: Path) -> str:
    h = hashlib.sha256()
    for name in DIGESTED_FILES + tuple(sorted(p.name for p in model_dir.glob("tokenization_*.py"))):
        path = model_dir / name
        if path.is_file():
            h.update(name.encode() + b"\0")
            with open(path, "rb") as fh:
                while block := fh.read(1 << 20):
                    h.update(block)
    return h.hexdigest()


# Files one of which a tokenizer directory holds (fast, SentencePiece, tiktoken, BPE/WordPiece vocabularies).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def check_tokenizer_dir(path: str) -> None:
    """A directory without any tokenizer file is named as such: transformers would otherwise blame a
    missing sentencepiece or tiktoken package, which is installed."""
    p = Path(path)
    if not p.exists():
        raise JobError(f"--tokenizer {path}: no such directory; point it at the model directory")
    if not p.is_dir():
        return
    if any((p / name).is_file() for name in TOKENIZER_FILES) or any(p.glob("*.tiktoken")):
        return
    raise JobError(
        f"--tokenizer {path} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)} or *.tiktoken); "
        "point it at the model directory that holds them, or copy them there from the model"
    )


def load_tokenizer(path: str, trust_remote_code: bool = True) -> Any:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # our parallelism is processes
    from transformers import AutoTokenizer

    check_tokenizer_dir(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise JobError(
            f"cannot load the tokenizer from {path}: {type(exc).__name__}: {exc}. Point --tokenizer at "
            f"the model directory and run with the venv that serves the model"
        ) from None
