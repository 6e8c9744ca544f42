"""Rendered pieces -> token ids and a loss mask that agree token for token.

The text is cut at every control token the *template* wrote (``<|im_end|>``, ``<think>``, ...): those
become their ids. Everything between two control tokens is one *run* of ordinary text -- template text and
message text together, exactly as a tokenizer would see it between special tokens -- and is encoded in one
call with special-token recognition off, so a ``<|im_end|>`` typed inside a message stays text (unless
``special_in_content="control"``). For conversations without such strings the ids therefore equal
``tokenizer.encode(rendered_text)``; the tests check that.

The policy for a control-token string typed inside a message (``special_in_content``):

- ``text`` (default): it is text. Its run is encoded as the tokenizer encodes text with no added token
  matched at all (special or not): tiktoken's ``encode_ordinary``, Kimi's ``allow_special_tokens=False``,
  or, for a fast tokenizer, its own normalizer, pre-tokenizer and model without the added-token table
  (``split_special_tokens`` alone still matches non-special added tokens such as Qwen3's ``<think>``).
  The whole run is encoded in one call, so the ids never depend on where the string sits in it or where
  the job cut the rendering: they are the tokenizer's encoding of the full rendering with the template's
  control tokens as their ids and everything between them as text. A tokenizer whose model would still
  produce a control id from that text gets the row refused (``unencodable_content``), never ids from a
  text cut in two.
- ``reject``: the row is refused (``special_token_in_content``).
- ``control``: the string becomes its control id, as ``tokenizer.encode(rendered_text)`` would give it.

A change of supervision inside a run (rare: Kimi's boundaries all sit on control tokens; Qwen's history
turns start right after ``assistant\\n``) is placed by encoding the run's prefix: when the prefix's tokens
are a prefix of the run's tokens the boundary is exact; otherwise one token straddles it, takes the
supervision of the side its first character is on (SpecForge's rule), and is counted.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from regen.tokenization.conversation import RowError
from regen.tokenization.render import Rendered

SPECIAL_IN_CONTENT = ("text", "reject", "control")


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    straddles: int = 0  # tokens that cross a supervision boundary
    special_in_content: int = 0  # message fields holding a control-token string


def _without_added_tokens(tokenizer: Any) -> Callable[[list[str]], list[list[int]]] | None:
    """A fast tokenizer's own pipeline (normalizer, pre-tokenizer, model) with no added token matched: how it
    encodes text that merely spells a special token. None when the tokenizer has no such backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    document = json.loads(backend.to_str())
    document["added_tokens"] = []
    textual = Tokenizer.from_str(json.dumps(document))
    textual.no_truncation()
    textual.no_padding()
    return lambda texts: (
        [e.ids for e in textual.encode_batch(texts, add_special_tokens=False)] if texts else []
    )


def _plain_encoder(tokenizer: Any) -> Callable[[list[str]], list[list[int]]]:
    """A batch encoder that treats every special-token string as text, using the tokenizer's own code."""
    encode = getattr(tokenizer, "encode", None)
    try:
        params = inspect.signature(encode).parameters if encode else {}
    except (TypeError, ValueError):
        params = {}
    if "allow_special_tokens" in params:
        # Moonshot's tokenization_kimi.py: encode(text, allow_special_tokens=False) runs tiktoken with every
        # special disallowed-as-special, after its own long-input chunking.
        return lambda texts: [encode(t, allow_special_tokens=False) for t in texts]
    model = getattr(tokenizer, "model", None)
    if model is not None and hasattr(model, "encode_ordinary") and hasattr(model, "n_vocab"):
        # A tiktoken-backed slow tokenizer: its _tokenize is encode_ordinary; skip the per-token Python layer.
        return lambda texts: [model.encode_ordinary(t) for t in texts]
    if getattr(tokenizer, "is_fast", False):

        def fast(texts: list[str]) -> list[list[int]]:
            if not texts:
                return []
            out = tokenizer(
                texts,
                add_special_tokens=False,
                split_special_tokens=True,
                return_attention_mask=False,
                return_token_type_ids=False,
            )
            return list(out["input_ids"])

        return fast
    return lambda texts: [
        tokenizer.encode(t, add_special_tokens=False, split_special_tokens=True) for t in texts
    ]


class PieceEncoder:
    def __init__(self, tokenizer: Any, *, special_in_content: str = "text"):
        if special_in_content not in SPECIAL_IN_CONTENT:
            raise ValueError(f"special_in_content must be one of {SPECIAL_IN_CONTENT}")
        self.special_in_content = special_in_content
        self.controls: dict[str, int] = dict(tokenizer.get_added_vocab())
        self.control_ids = frozenset(self.controls.values())
        self._control_re = (
            re.compile("|".join(re.escape(t) for t in sorted(self.controls, key=len, reverse=True)))
            if self.controls
            else None
        )
        self._plain = _plain_encoder(tokenizer)
        self._tokenizer = tokenizer
        self._textual: Callable[[list[str]], list[list[int]]] | None = None  # built on first need

    # ------------------------------------------------------------------ plain text

    def _as_text(self, texts: list[str]) -> list[list[int]]:
        """Encode runs that spell an added token the plain encoder still matched (a fast tokenizer's
        non-special added tokens, e.g. Qwen3's ``<think>``), each whole, with no added token matched."""
        if self._textual is None:
            self._textual = _without_added_tokens(self._tokenizer) or self._plain
        out = self._textual(texts)
        for text, ids in zip(texts, out, strict=True):
            if not self.control_ids.isdisjoint(ids):
                found = sorted({t for t in self.controls if t in text})
                raise RowError(
                    "unencodable_content",
                    f"this tokenizer encodes {', '.join(found) or 'a special-token string'} typed in a "
                    "message as its control token even as text; use --special-in-content reject or control",
                )
        return out

    def plain(self, texts: list[str]) -> list[list[int]]:
        out = self._plain(texts)
        if self.control_ids:
            again = [n for n, ids in enumerate(out) if not self.control_ids.isdisjoint(ids)]
            for n, ids in zip(again, self._as_text([texts[n] for n in again]) if again else [], strict=True):
                out[n] = ids
        return out

    # ------------------------------------------------------------------ conversations

    def _runs(self, rendered: Rendered) -> tuple[list[Any], int]:
        """Items: ("ctl", id, supervised) or ("run", [(text, supervised), ...]); plus the count of message
        fields that hold a control-token string."""
        items: list[Any] = []
        run: list[tuple[str, bool]] = []
        special = 0

        def flush() -> None:
            if run:
                items.append(("run", list(run)))
                run.clear()

        for piece in rendered.pieces:
            has_control = self._control_re is not None and self._control_re.search(piece.text) is not None
            if piece.content and has_control:
                special += 1
                if self.special_in_content == "reject":
                    raise RowError(
                        "special_token_in_content", "a message holds a special-token string (policy: reject)"
                    )
            if not has_control or (piece.content and self.special_in_content != "control"):
                run.append((piece.text, piece.supervised))
                continue
            pos = 0
            for match in self._control_re.finditer(piece.text):  # type: ignore[union-attr]
                if match.start() > pos:
                    run.append((piece.text[pos : match.start()], piece.supervised))
                flush()
                items.append(("ctl", self.controls[match.group(0)], piece.supervised))
                pos = match.end()
            if pos < len(piece.text):
                run.append((piece.text[pos:], piece.supervised))
        flush()
        return items, special

    def encode_many(self, rendered: Sequence[Rendered]) -> list[Encoded | RowError]:
        """Encode a batch (one tokenizer call for all runs); a row that fails gets its RowError instead."""
        plans: list[tuple[list[Any], int] | RowError] = []
        texts: list[str] = []
        for r in rendered:
            try:
                items, special = self._runs(r)
            except RowError as exc:
                plans.append(exc)
                continue
            plans.append((items, special))
            texts.extend("".join(t for t, _ in item[1]) for item in items if item[0] == "run")
        try:
            encoded_runs = iter(self.plain(texts))
        except RowError:
            # One bad run must not sink the batch: redo row by row.
            if len(rendered) == 1:
                raise
            return [self.encode_many([r])[0] for r in rendered]
        out: list[Encoded | RowError] = []
        for plan in plans:
            if isinstance(plan, RowError):
                out.append(plan)
                continue
            items, special = plan
            result = Encoded([], [], special_in_content=special)
            for item in items:
                if item[0] == "ctl":
                    result.input_ids.append(item[1])
                    result.loss_mask.append(1 if item[2] else 0)
                    continue
                ids = next(encoded_runs)
                self._mask_run(item[1], ids, result)
            out.append(result)
        return out

    def encode(self, rendered: Rendered) -> Encoded:
        result = self.encode_many([rendered])[0]
        if isinstance(result, RowError):
            raise result
        return result

    def _mask_run(self, fragments: list[tuple[str, bool]], ids: list[int], result: Encoded) -> None:
        flags = {sup for _, sup in fragments}
        if len(flags) == 1:
            result.input_ids.extend(ids)
            result.loss_mask.extend([1 if fragments[0][1] else 0] * len(ids))
            return
        text = "".join(t for t, _ in fragments)
        # Token index of each supervision change, from the encoded length of the text before it.
        cuts: list[tuple[int, bool]] = []  # (first token index, supervision from there on)
        offset = 0
        previous: bool | None = None
        for fragment, sup in fragments:
            if sup != previous:
                if offset == 0:
                    cuts.append((0, sup))
                else:
                    prefix = self.plain([text[:offset]])[0]
                    n = min(len(prefix), len(ids))
                    if ids[:n] != prefix:
                        result.straddles += 1
                    cuts.append((n, sup))
                previous = sup
            offset += len(fragment)
        mask = [0] * len(ids)
        for (start, sup), following in zip(cuts, [*cuts[1:], (len(ids), False)], strict=True):
            if sup:
                for i in range(start, max(start, following[0])):
                    mask[i] = 1
        result.input_ids.extend(ids)
        result.loss_mask.extend(mask)
