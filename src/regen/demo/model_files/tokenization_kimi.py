# Tokenizer of the regen demo model. Written by the regen project (not Moonshot code); copied into the
# demo model directory by `python -m regen.demo.build` and loaded with trust_remote_code=True.
"""A tiktoken BPE tokenizer with Kimi-style special tokens, shaped like the real Kimi K2.5/K2.6 one.

Like the real checkpoint, it is slow-tokenizer remote code: ``tokenizer_config.json`` maps AutoTokenizer
to ``tokenization_kimi.TikTokenTokenizer`` (no fast class), the BPE ranks live in ``tiktoken.model``
("<base64 bytes> <rank>" per line) and every special token id sits above the ranks. ``import tiktoken`` is
at the top on purpose: in an environment without tiktoken, loading fails the way the real one does.
"""

import os
import shutil
from typing import Any, ClassVar

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import AddedToken, PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

# Number of ids reserved above the BPE ranks for special tokens (the real tokenizer reserves 256 too).
NUM_RESERVED_SPECIAL_TOKENS = 256

# Pre-tokenization: runs of Han characters stand alone (as in Kimi's tokenizer); other letters form words
# with an optional leading space or sign and English contractions; digits group by at most three;
# punctuation runs keep a leading space and trailing newlines; whitespace is split so a final space
# before a word stays with that word. The builder trains the ranks with this same pattern.
PAT_STR = "|".join(
    [
        r"\p{Han}+",
        r"[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})[\p{L}\p{M}])+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def _bytes_to_unicode() -> dict[int, str]:
    """Printable stand-ins for the 256 byte values, so byte-level tokens can be handled as ``str``."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


class TikTokenTokenizer(PreTrainedTokenizer):
    """Byte-level BPE over tiktoken, special tokens at ids ``len(ranks) .. len(ranks) + 255``."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str = "[UNK]",
        pad_token: str = "[PAD]",
        added_tokens_decoder: dict[int, AddedToken] | None = None,
        **kwargs: Any,
    ):
        if not os.path.isfile(vocab_file):
            raise ValueError(f"BPE ranks file {vocab_file!r} not found: the model directory must ship it")
        self.vocab_file = vocab_file
        mergeable_ranks = load_tiktoken_bpe(vocab_file)
        self.num_base_tokens = len(mergeable_ranks)

        added_tokens_decoder = dict(added_tokens_decoder or {})
        special_tokens: dict[str, int] = {}
        for token_id in range(self.num_base_tokens, self.num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS):
            token = added_tokens_decoder.get(token_id)
            content = token.content if token is not None else f"<|reserved_token_{token_id}|>"
            special_tokens[content] = token_id
        self.special_tokens = special_tokens
        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file),
            pat_str=PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=special_tokens,
        )

        byte_encoder = _bytes_to_unicode()
        self._byte_decoder = {char: byte for byte, char in byte_encoder.items()}
        self._id_to_token = {
            rank: "".join(byte_encoder[byte] for byte in token) for token, rank in mergeable_ranks.items()
        }
        self._id_to_token.update({token_id: content for content, token_id in special_tokens.items()})
        self._token_to_id = {token: token_id for token_id, token in self._id_to_token.items()}

        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=added_tokens_decoder,
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._token_to_id)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Special-token strings were already split off by the caller; treat the rest as plain text.
        return [self._id_to_token[token_id] for token_id in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_token.get(index, self.unk_token)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytearray()
        for token in tokens:
            if token in self.special_tokens:
                data.extend(token.encode("utf-8"))
            else:
                data.extend(self._byte_decoder[char] for char in token)
        return data.decode("utf-8", errors="replace")

    def _decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        # Decode through tiktoken by id: faster than token strings, and exact for partial UTF-8 sequences.
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if skip_special_tokens:
            # Like any transformers tokenizer: the named and additional special tokens go, other added
            # tokens (<think>, </think>, tool-call markers) stay, so reasoning parsers still find them.
            skipped = set(self.all_special_ids)
            token_ids = [token_id for token_id in token_ids if token_id not in skipped]
        return self.model.decode([int(token_id) for token_id in token_ids], errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"Cannot save the BPE ranks: {save_directory!r} is not a directory")
        name = (f"{filename_prefix}-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, target)
        return (target,)


__all__ = ["TikTokenTokenizer"]
