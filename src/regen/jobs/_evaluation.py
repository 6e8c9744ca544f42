"""What the two evaluation jobs share: the prompts they evaluate and the flags that choose them.

`regen.jobs.evaluate` (the reference decoder) and `regen.jobs.evaluate_serving` (SGLang with and without
the drafter) pick the same prompts the same way (a keyed hash of each id under --seed), render them with
the same chat-template settings, and take those inputs through the same flags, declared here once; each
job gives its own defaults for the amounts.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
from pathlib import Path
from typing import Any

from ._common import JobError, canonical_json, decode_json_line, iter_lines, kv

log = logging.getLogger("regen.jobs.evaluate")


def add_evaluation_inputs(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    max_prompts: int,
    max_new_tokens: int,
    seed_help: str,
    force_help: str,
) -> None:
    """The flags both evaluation jobs take: the models, the prompts, the output, the turn settings."""
    parser.add_argument(
        "--target-model",
        type=Path,
        required=True,
        help="the target model directory (its tokenizer renders the prompts)",
    )
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="the exported drafter (config.json + safetensors)"
    )
    parser.add_argument(
        "--prompts", type=Path, required=True, help="JSONL file or directory of *.jsonl shards"
    )
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--max-prompts", type=int, default=max_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument(
        "--prompt-max-tokens", type=int, default=256, help="longer prompts keep their last tokens"
    )
    parser.add_argument(
        "--chat-template-kwargs",
        default="{}",
        help="chat-template variables the completions were generated with, e.g. '{\"thinking\": true}' "
        "(the plan's generation.chat_template_kwargs)",
    )
    parser.add_argument(
        "--thinking-switch",
        default="",
        help="the template's boolean thinking variable (the plan's generation.thinking_switch, e.g. "
        "`thinking` for Kimi, `enable_thinking` for Qwen3); needed by --turn-kinds",
    )
    parser.add_argument(
        "--turn-kinds",
        default="",
        help="comma list of thinking,non-thinking: every prompt is evaluated as each kind of turn (the "
        "switch set on or off over --chat-template-kwargs); empty: only the turns the kwargs give",
    )
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument("--no-trust-remote-code", action="store_true")
    parser.add_argument("--force", action="store_true", help=force_help)


def prompt_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.iterdir()
            if p.name.endswith((".jsonl", ".jsonl.gz")) and p.name != "rejects.jsonl"
        )
        if files:
            return files
    raise JobError(
        f"no prompts at {path}: pass a JSONL file or the prompts stage's directory of *.jsonl shards "
        "(-e evaluate_prompts=PATH)"
    )


def first_user_turn(conversation: Any) -> list[dict[str, str]] | None:
    """System turns and the first user turn: what the target is asked to answer (as SpecForge's bench)."""
    if not isinstance(conversation, list):
        return None
    cut = []
    for turn in conversation:
        if not isinstance(turn, dict) or turn.get("role") not in ("system", "user"):
            continue
        if not isinstance(turn.get("content"), str):
            return None
        cut.append({"role": turn["role"], "content": turn["content"]})
        if turn["role"] == "user":
            return cut
    return None


def selection_key(seed: int, prompt_id: str) -> str:
    """Prompts are picked by a keyed hash of their id: the same set whatever order the files list them in."""
    return hashlib.sha256(f"{seed}:{prompt_id}".encode()).hexdigest()


def load_prompts(path: Path, limit: int, seed: int) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for file in prompt_files(path):
        for lineno, raw in iter_lines(file):
            row, err = decode_json_line(raw)
            turns = (
                first_user_turn(row.get("conversations") or row.get("messages"))
                if isinstance(row, dict)
                else None
            )
            if err or turns is None:
                log.warning(
                    "prompt skipped", extra=kv(file=str(file), line=lineno, reason=err or "no user turn")
                )
                continue
            pid = str(row.get("id") or hashlib.sha256(canonical_json(turns)).hexdigest()[:16])
            category = row.get("category") or (row.get("metadata") or {}).get("category")
            rows.setdefault(pid, {"id": pid, "turns": turns, "category": category})
    if not rows:
        raise JobError(f"no usable prompt in {path}: rows need `conversations` with a user turn")
    picked = sorted(rows.values(), key=lambda r: selection_key(seed, r["id"]))[:limit]
    return sorted(picked, key=lambda r: r["id"])
