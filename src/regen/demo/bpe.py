"""Train the demo tokenizer's byte-level BPE ranks and write them in tiktoken's ``tiktoken.model`` format.

The ranks are learned with the ``tokenizers`` library's BPE trainer on text the project ships
(``corpus.txt``) plus generated number lines, using the same pre-tokenization pattern the tokenizer uses
at run time. They are converted to tiktoken ranks: the 256 single bytes first (rank = byte value), then
each learned merge in the order it was learned, so a merge's rank is its priority. Training is
deterministic: the same corpus, pattern and size give the same ranks, byte for byte.
"""

from __future__ import annotations

import base64
import json
from importlib import resources

CORPUS_RESOURCE = "corpus.txt"


def corpus_text() -> str:
    return resources.files("regen.demo").joinpath(CORPUS_RESOURCE).read_text(encoding="utf-8")


def number_lines() -> str:
    """Every 1-3 digit group a few times in number-like contexts (digits pre-tokenize in groups of 3)."""
    lines = []
    for value in range(1000):
        lines.append(f"{value} {value:03d} {(value * 37) % 1000}.{(value * 11) % 100:02d} #{value:x}")
    return "\n".join(lines) + "\n"


def training_texts() -> list[str]:
    return [corpus_text(), number_lines()]


def _byte_level_alphabet() -> dict[str, int]:
    """The printable character the byte-level pre-tokenizer uses for each byte, mapped back to the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            mapping[chr(256 + shifted)] = byte
            shifted += 1
    return mapping


def train_ranks(texts: list[str], num_ranks: int, pattern: str) -> dict[bytes, int]:
    """Learn ``num_ranks`` tiktoken ranks (256 bytes + merges) from ``texts``.

    Raises ValueError when the texts are too small to learn that many merges.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=num_ranks,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)

    byte_of = _byte_level_alphabet()
    ranks = {bytes([byte]): byte for byte in range(256)}
    for merge in json.loads(tokenizer.to_str())["model"]["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        token = bytes(byte_of[char] for char in left) + bytes(byte_of[char] for char in right)
        if token not in ranks and len(ranks) < num_ranks:
            ranks[token] = len(ranks)
    if len(ranks) != num_ranks:
        raise ValueError(
            f"the demo corpus only yields {len(ranks)} BPE ranks, {num_ranks} were asked for: "
            "add text to src/regen/demo/corpus.txt or lower num_bpe_ranks"
        )
    return ranks


def dump_tiktoken(ranks: dict[bytes, int]) -> bytes:
    """tiktoken's BPE file: one ``<base64 token> <rank>`` line per token, by rank."""
    lines = [
        base64.b64encode(token) + b" " + str(rank).encode("ascii")
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
    return b"\n".join(lines) + b"\n"
