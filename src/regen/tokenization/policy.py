"""What makes an encoded conversation a training sample: length, supervision, the mask token."""

from __future__ import annotations

import itertools
from typing import Any

from regen.tokenization.conversation import RowError

TRUNCATION_POLICIES = ("truncate", "drop")


def has_consecutive_supervised_tokens(loss_mask: list[int]) -> bool:
    """SpecForge's DFlash reader (``specforge.data.loss_mask``) rejects samples without two adjacent 1s."""
    return any(a and b for a, b in itertools.pairwise(loss_mask))


def apply_length_policy(
    input_ids: list[int], loss_mask: list[int], max_length: int | None, policy: str
) -> tuple[list[int], list[int], bool]:
    """Cut to `max_length` (keeping the start, as SpecForge's own tokenization does) or reject with
    reason ``too_long``. Returns (ids, mask, truncated)."""
    if max_length is None or len(input_ids) <= max_length:
        return input_ids, loss_mask, False
    if policy == "drop":
        raise RowError("too_long", f"{len(input_ids)} tokens > --max-length {max_length} (policy: drop)")
    return input_ids[:max_length], loss_mask[:max_length], True


def check_supervision(loss_mask: list[int]) -> None:
    if not has_consecutive_supervised_tokens(loss_mask):
        raise RowError(
            "insufficient_supervision",
            f"{sum(loss_mask)} supervised token(s) and no two in a row; DFlash cannot train on it",
        )


def check_mask_token(tokenizer: Any, mask_token_id: int) -> str:
    """The mask id must be a real token of this tokenizer; returns its string. Raises ValueError."""
    size = len(tokenizer)
    if not 0 <= mask_token_id < size:
        raise ValueError(f"mask token id {mask_token_id} is outside the tokenizer's {size} ids")
    token = tokenizer.convert_ids_to_tokens(mask_token_id)
    if not token:
        raise ValueError(f"mask token id {mask_token_id} has no token in this tokenizer's vocabulary")
    return str(token)
