"""Evaluate a DFlash drafter: acceptance length, acceptance by position and speedup over plain decoding.

    python -m regen.jobs.evaluate --target-model DIR --checkpoint DRAFTER_DIR --prompts PATH \
        --output-dir DIR [--max-prompts N] [--max-new-tokens N] [--chat-template-kwargs JSON] \
        [--thinking-switch NAME --turn-kinds thinking,non-thinking] [--training-steps N] [--seed S] [--force]

Runs the reference decoder (`regen.evaluate.reference`: the target through transformers, the drafter through
SpecForge's own DFlashDraftModel; on the CPU, or on a GPU with --device cuda) on the same prompts with
greedy decoding, one sequence at a time, for three drafters:
`trained` (the checkpoint), `untrained` (the same config, freshly initialised: about 1.0) and `oracle`
(proposes the target's own greedy continuation: the block size). Every speculative output is compared
with plain greedy decoding of the same prompt (`lossless`).

PROMPTS is a JSONL file (or a directory of `*.jsonl` shards, as the prompts stage writes) of
`{"id", "conversations": [{"role", "content"}...], "category"?}` rows; the prompt is the conversation up to
its first user turn, rendered with the target's chat template and --chat-template-kwargs (what the
completions were generated with). A `category` (code/math/chat...) gives per-category figures; with
--turn-kinds every prompt is evaluated as each kind of turn (the template's --thinking-switch on or off),
with figures per kind. --training-steps N also evaluates the trained drafter at up to N earlier checkpoints
of its training run (an export of the train stage names its run and step): acceptance against step.

Output in DIR: `report.json`, `report.md`, PNG plots, `results.jsonl` (one line per drafter, prompt and
turn kind, so an interrupted run resumes where it stopped) and `status.json`. The report records a digest
of its inputs (checkpoint, target, prompts, settings): a second run on the same inputs re-evaluates nothing
and prints `"changed": false`. Exit codes: 0 done, 1 some speculative output differed from greedy decoding
(see report.md), 2 bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from regen.status import RUNNING_STATES, Status

from .. import __version__
from ..fsio import atomic_write_bytes, atomic_write_json
from ._common import (
    EXIT_FAILED_RECORDS,
    EXIT_OK,
    EXIT_USAGE,
    JobError,
    StatusFile,
    canonical_json,
    decode_json_line,
    iter_lines,
    job_parser,
    json_object_arg,
    kv,
    run_main,
    setup_logging,
    sha256_file,
)
from ._evaluation import add_evaluation_inputs, load_prompts

log = logging.getLogger("regen.jobs.evaluate")

# Bumped when what the harness measures changes, so old reports are not mistaken for current ones.
METHOD = "dflash-greedy-chain+ddtree/3"
DRAFTER_CHOICES = ("trained", "untrained", "oracle")
__all__ = ["EXIT_FAILED_RECORDS", "EXIT_OK", "EXIT_USAGE", "JobError", "main", "run_main"]
FULL_HASH_LIMIT = 1 << 30  # model files above this are identified by name and size, not content


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def files_digest(directory: Path, patterns: tuple[str, ...]) -> str:
    """Content hash of a model directory's config and weights (name + size only for very large files)."""
    h = hashlib.sha256()
    for pattern in patterns:
        for file in sorted(directory.glob(pattern)):
            size = file.stat().st_size
            h.update(f"{file.name}\0{size}\0".encode())
            if size <= FULL_HASH_LIMIT:
                h.update(sha256_file(file).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Resumable results
# --------------------------------------------------------------------------------------------------


class Results:
    """results.jsonl: one line per (drafter, prompt, turn kind) for the current inputs digest; lines of
    another digest are dropped when the file is opened, so a changed checkpoint is evaluated afresh."""

    def __init__(self, path: Path, digest: str):
        self.path = path
        self.digest = digest
        self.rows: dict[tuple[str, str, str], dict[str, Any]] = {}
        if path.exists():
            for _, raw in iter_lines(path):
                row, err = decode_json_line(raw)
                if not err and isinstance(row, dict) and row.get("digest") == digest:
                    self.rows[self.key(row)] = row
        # Rewrite now: drops stale lines and a torn last line from a crash.
        atomic_write_bytes(path, b"".join(json.dumps(r).encode() + b"\n" for r in self.rows.values()))

    @staticmethod
    def key(row: dict[str, Any]) -> tuple[str, str, str]:
        return (row["drafter"], row["prompt_id"], row.get("turn_kind", "default"))

    def has(self, drafter: str, prompt_id: str, turn_kind: str = "default") -> bool:
        return (drafter, prompt_id, turn_kind) in self.rows

    def add(self, row: dict[str, Any]) -> None:
        row = {**row, "digest": self.digest}
        self.rows[self.key(row)] = row
        with open(self.path, "ab") as fh:
            fh.write(json.dumps(row).encode() + b"\n")
            fh.flush()
            os.fsync(fh.fileno())


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = job_parser(
        "python -m regen.jobs.evaluate",
        "Acceptance length and speedup of a DFlash drafter (reference decoder on the CPU or a GPU, greedy).",
        status=False,
        progress=False,
    )
    add_evaluation_inputs(
        p,
        max_prompts=8,
        max_new_tokens=32,
        seed_help="the seeded prompt selection and the untrained drafter's init",
        force_help="re-evaluate even when the report is up to date",
    )
    p.add_argument(
        "--drafters", default=",".join(DRAFTER_CHOICES), help="comma list of trained,untrained,oracle"
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--tree-budgets",
        default="4,16,64",
        help="DDTree node budgets scored beside the chain (comma list; empty: none)",
    )
    p.add_argument(
        "--training-steps",
        type=int,
        default=0,
        help="also evaluate up to N earlier checkpoints the training run kept (found through the export's "
        "regen-export-step*.json marker), trained drafter only, chain verification, the first turn kind: "
        "acceptance against training step (0: none)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the target and drafters run: cpu (default), cuda or cuda:N (the reference on a GPU: "
        "one sequence at a time, so its tokens/s measure the decoding algorithm, not a serving engine)",
    )
    p.add_argument("--status-file", type=Path, help="status JSON (default: OUTPUT_DIR/status.json)")
    return p


def export_marker(checkpoint: Path) -> dict[str, Any] | None:
    """The train stage's `regen-export-step<N>.json` in an export directory: {checkpoint, step, run_id}."""
    for marker in sorted(checkpoint.glob("regen-export-step*.json")):
        doc = load_json_object(marker)
        if doc and isinstance(doc.get("step"), int) and doc.get("checkpoint") and doc.get("run_id"):
            return doc
    return None


def earlier_checkpoints(checkpoint: Path, limit: int) -> tuple[int | None, list[dict[str, Any]]]:
    """(step of the evaluated export, up to `limit` other complete checkpoints of its run, oldest first).

    Only an export of the train stage says which run and step it came from; a drafter of the user's has
    no series to draw.
    """
    marker = export_marker(checkpoint)
    if marker is None or limit < 1:
        return (marker or {}).get("step"), []
    from ..training.checkpoints import list_checkpoints

    found = list_checkpoints(Path(marker["checkpoint"]).parent, marker["run_id"])
    others = [c for c in found if c["complete"] and c["step"] != marker["step"]]
    return marker["step"], others[-limit:]


def export_step(checkpoint: dict[str, Any], draft_config: Path, out: Path) -> Path:
    """An earlier SpecForge checkpoint as an HF drafter directory, through SpecForge's own exporter (the
    call `specforge export --to hf` makes), once per checkpoint."""
    target = out / f"step{checkpoint['step']}"
    if (target / "config.json").is_file() and list(target.glob("*.safetensors")):
        return target
    from specforge.export import export_to_hf

    staging = out / f".step{checkpoint['step']}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    export_to_hf(checkpoint["path"], str(draft_config), str(staging))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


def _drafters(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in DRAFTER_CHOICES]
    if bad or not names:
        raise JobError(f"--drafters {text!r}: choose from {', '.join(DRAFTER_CHOICES)}")
    return names


TURN_KINDS = ("thinking", "non-thinking")


def turn_kinds(kwargs_text: str, switch: str, kinds_text: str) -> dict[str, dict[str, Any]]:
    """Kind of turn -> the chat-template variables that render it.

    Without --turn-kinds there is one kind: the turns --chat-template-kwargs gives, named after its
    thinking switch when that is known (`thinking` / `non-thinking`), else `default`.
    """
    kwargs = json_object_arg(kwargs_text, "--chat-template-kwargs")
    kinds = [k.strip() for k in kinds_text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in TURN_KINDS]
    if bad:
        raise JobError(f"--turn-kinds {kinds_text!r}: choose from {', '.join(TURN_KINDS)}")
    if kinds and not switch:
        raise JobError(
            "--turn-kinds needs --thinking-switch (the chat template's thinking variable, the plan's "
            "generation.thinking_switch); this model's template may have none: leave --turn-kinds empty"
        )
    if switch and switch in kwargs and not isinstance(kwargs[switch], bool):
        raise JobError(
            f"--chat-template-kwargs sets {switch}={kwargs[switch]!r}: turn kinds need a true/false switch"
        )
    if not kinds:
        if not switch:
            return {"default": kwargs}
        return {"thinking" if kwargs.get(switch, True) else "non-thinking": kwargs}
    return {kind: {**kwargs, switch: kind == "thinking"} for kind in dict.fromkeys(kinds)}


def _tokenize(
    tokenizer: Any, turns: list[dict[str, str]], limit: int, kwargs: dict[str, Any] | None = None
) -> list[int]:
    text = tokenizer.apply_chat_template(
        turns, tokenize=False, add_generation_prompt=True, **(kwargs or {})
    )
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids[-limit:]


def _stop_ids(tokenizer: Any, model: Any) -> list[int]:
    return stop_ids(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None))


def stop_ids(tokenizer: Any, eos: Any) -> list[int]:
    """The tokens that end an answer: the generation config's EOS (one id or a list), the tokenizer's,
    and the chat template's end-of-turn token where the vocabulary has one."""
    ids = set()
    for value in (eos if isinstance(eos, list) else [eos]) + [tokenizer.eos_token_id]:
        if isinstance(value, int):
            ids.add(value)
    for token in ("<|im_end|>",):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(ids)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    drafters = _drafters(args.drafters)
    try:
        budgets = sorted({int(x) for x in args.tree_budgets.split(",") if x.strip()})
    except ValueError:
        raise JobError(
            f"--tree-budgets {args.tree_budgets!r}: a comma list of node counts, e.g. 4,16,64"
        ) from None
    if any(b < 1 for b in budgets):
        raise JobError("--tree-budgets: every budget must be at least 1 node")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise JobError(f"--device {args.device!r}: use cpu, cuda or cuda:N")
    if args.max_prompts < 1 or args.max_new_tokens < 1:
        raise JobError("--max-prompts and --max-new-tokens must be at least 1")
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    status = StatusFile(args.status_file or out / "status.json", interval=2.0)

    from ..evaluate import reference as ref
    from ..evaluate.report import build_report, draw_plots, headline, render_markdown

    try:
        ref.drafter_config(args.checkpoint)
        checkpoint_info = ref.checkpoint_summary(args.checkpoint)
    except (OSError, ValueError, ref.EvaluationError) as exc:
        raise JobError(str(exc)) from exc
    if not (args.target_model / "config.json").is_file():
        raise JobError(
            f"{args.target_model} has no config.json: pass the target model directory (--target-model)"
        )
    prompts = load_prompts(args.prompts, args.max_prompts, args.seed)
    kinds = turn_kinds(args.chat_template_kwargs, args.thinking_switch, args.turn_kinds)
    if args.training_steps < 0:
        raise JobError("--training-steps must be 0 (none) or more")
    exported_step, earlier = (
        earlier_checkpoints(args.checkpoint, args.training_steps)
        if "trained" in drafters
        else (None, [])
    )
    settings = {
        "method": METHOD,
        "drafters": drafters,
        "max_prompts": args.max_prompts,
        "max_new_tokens": args.max_new_tokens,
        "prompt_max_tokens": args.prompt_max_tokens,
        "dtype": args.dtype,
        "seed": args.seed,
        "tree_budgets": budgets,
        "turn_kinds": kinds,
        "device": args.device,
        "prompts_source": str(args.prompts),
    }
    inputs = {
        "checkpoint": str(args.checkpoint),
        "checkpoint_digest": files_digest(args.checkpoint, ("config.json", "*.safetensors")),
        "target_model": str(args.target_model),
        "target_digest": files_digest(args.target_model, ("config.json", "*.safetensors", "*.py", "*.model")),
        "prompts_digest": hashlib.sha256(canonical_json(prompts)).hexdigest(),
        "prompt_ids": [p["id"] for p in prompts],
        "drafter": checkpoint_info,
        "exported_step": exported_step,
        "earlier_checkpoints": [
            {"step": c["step"], "digest": files_digest(Path(c["path"]), ("*.pt",))} for c in earlier
        ],
    }
    digest = hashlib.sha256(canonical_json({"settings": settings, "inputs": inputs})).hexdigest()
    report_path = out / "report.json"
    current = exit_if_report_current(report_path, digest, args.force)
    if current is not None:
        return current

    import torch
    from transformers import AutoTokenizer

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise JobError(
            f"--device {args.device}: torch {torch.__version__} sees no GPU here; use --device cpu"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    trust = not args.no_trust_remote_code
    target = ref.Target.load(args.target_model, args.dtype, trust, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(str(args.target_model), trust_remote_code=trust)
    stops = _stop_ids(tokenizer, target.model)
    trained = ref.load_drafter(args.checkpoint, args.dtype, args.device)
    ref.check_compatible(trained, target)
    block, mask, layers = int(trained.block_size), int(trained.mask_token_id), list(trained.target_layer_ids)
    proposers: dict[str, Any] = {}
    if "trained" in drafters:
        proposers["trained"] = ref.DFlashProposer(trained, target)
    if "untrained" in drafters:
        proposers["untrained"] = ref.DFlashProposer(
            ref.fresh_drafter(args.checkpoint, args.seed, args.dtype, args.device), target
        )

    results = Results(out / "results.jsonl", digest)

    def _speculative(proposer: Any, ids: list[int], **extra: Any) -> Any:
        return ref.speculative_decode(
            target,
            proposer,
            ids,
            block_size=block,
            mask_token_id=mask,
            layer_ids=layers,
            max_new=args.max_new_tokens,
            stop_ids=stops,
            **extra,
        )

    total = len(prompts) * (len(drafters) * len(kinds) + len(earlier))
    began = time.monotonic()

    def _run_all() -> None:
        """Every drafter over every prompt not yet in `results` (each run is committed as it ends)."""
        # Untimed decodes first: the first forwards pay one-off costs (allocations, kernel selection, on a
        # GPU its libraries' start), which would otherwise be charged to whichever decode came first.
        first_kwargs = next(iter(kinds.values()))
        warm = _tokenize(tokenizer, prompts[0]["turns"], args.prompt_max_tokens, first_kwargs)
        ref.greedy_decode(target, warm, 4, stops)
        for proposer in proposers.values():
            ref.speculative_decode(
                target, proposer, warm, block_size=block, mask_token_id=mask, layer_ids=layers, max_new=4
            )
        for kind, kwargs in kinds.items():
            for prompt in prompts:
                if all(results.has(name, prompt["id"], kind) for name in drafters):
                    continue
                _run_prompt(prompt, kind, kwargs)
        # Acceptance against training step: the earlier checkpoints on the same prompts, first turn kind.
        kind, kwargs = next(iter(kinds.items()))
        for checkpoint in earlier:
            name = f"trained@{checkpoint['step']}"
            if all(results.has(name, p["id"], kind) for p in prompts):
                continue
            path = export_step(checkpoint, args.checkpoint / "config.json", out / "steps")
            proposer = ref.DFlashProposer(ref.load_drafter(path, args.dtype, args.device), target)
            for prompt in prompts:
                if results.has(name, prompt["id"], kind):
                    continue
                ids = _tokenize(tokenizer, prompt["turns"], args.prompt_max_tokens, kwargs)
                spec = _speculative(proposer, ids)
                results.add(
                    {
                        "drafter": name,
                        "step": checkpoint["step"],
                        "prompt_id": prompt["id"],
                        "turn_kind": kind,
                        "category": prompt["category"],
                        "accepted": spec.accepted,
                        "tokens": len(spec.tokens),
                        "seconds": round(spec.seconds, 6),
                    }
                )
                status.maybe_write(lambda: progress("running"))

    def _run_prompt(prompt: dict[str, Any], kind: str, kwargs: dict[str, Any]) -> None:
        ids = _tokenize(tokenizer, prompt["turns"], args.prompt_max_tokens, kwargs)
        # Plain greedy decoding (timed), then on to the target's own continuation a block longer than the
        # output, so the last step is full too: the oracle's drafts and the truth DDTree paths are checked on.
        plain = ref.greedy_decode(
            target, ids, args.max_new_tokens, stops, continue_to=args.max_new_tokens + block
        )
        cont = ids + plain.continuation
        for name in drafters:
            if results.has(name, prompt["id"], kind):
                continue
            if name == "oracle":
                proposer: Any = ref.OracleProposer(cont, block)
            else:
                proposer = proposers[name]
            spec = _speculative(
                proposer, ids, tree_budgets=budgets if name != "oracle" else (), continuation=cont
            )
            lossless = spec.tokens == plain.tokens
            if not lossless:
                log.error(
                    "speculative output differs from greedy decoding",
                    extra=kv(
                        drafter=name,
                        prompt=prompt["id"],
                        turn_kind=kind,
                        first_diff=_first_diff(spec.tokens, plain.tokens),
                    ),
                )
            results.add(
                {
                    "drafter": name,
                    "prompt_id": prompt["id"],
                    "turn_kind": kind,
                    "category": prompt["category"],
                    "accepted": spec.accepted,
                    "tokens": len(spec.tokens),
                    "seconds": round(spec.seconds, 6),
                    "plain_tokens": len(plain.tokens),
                    "plain_seconds": round(plain.seconds, 6),
                    "lossless": lossless,
                    "tree": {str(b): steps for b, steps in spec.tree_accepted.items()},
                }
            )
            log.info(
                "evaluated",
                extra=kv(
                    drafter=name,
                    prompt=prompt["id"],
                    turn_kind=kind,
                    steps=spec.steps,
                    tokens=len(spec.tokens),
                    lossless=lossless,
                ),
            )
            status.maybe_write(lambda: progress("running"))

    def progress(state: str, error: str | None = None) -> dict[str, Any]:
        """The status document (`regen.status`): one unit is one drafter's run over one prompt, as one
        kind of turn (earlier checkpoints: the trained drafter at that step)."""
        done = len(results.rows)
        ended = state not in RUNNING_STATES
        return Status(
            job="evaluate",
            state=state,
            item="run",
            line=f"evaluate: state={state} runs={done}/{total} (drafter x prompt x turn kind)",
            done=done,
            total=total,
            exit_code=(EXIT_OK if state == "succeeded" else EXIT_FAILED_RECORDS) if ended else None,
            error=error,
        ).document(elapsed_s=round(time.monotonic() - began, 1), drafters=drafters)

    status.maybe_write(lambda: progress("running"), force=True)
    status.arm()  # an error from here on ends as `failed` (or interrupted) in status.json (run_main)
    _run_all()

    rows = [results.rows[(name, p["id"], kind)] for kind in kinds for p in prompts for name in drafters]
    first_kind = next(iter(kinds))
    step_rows = [
        results.rows[(f"trained@{c['step']}", p["id"], first_kind)] for c in earlier for p in prompts
    ]
    report = build_report(
        rows,
        block_size=block,
        settings=settings,
        inputs=inputs,
        step_rows=step_rows,
        exported_step=exported_step,
    )
    report["inputs_digest"] = digest
    report["regen_version"] = __version__
    plots, note = draw_plots(report, out)
    atomic_write_bytes(out / "report.md", render_markdown(report, [str(p) for p in plots], note).encode())
    atomic_write_json(report_path, report)  # last: its digest marks the evaluation complete
    status.disarm()
    if report["lossless"]:
        status.maybe_write(lambda: progress("succeeded"), force=True, durable=True)
    else:
        lost = "speculative output differs from greedy decoding: see the log and results.jsonl"
        status.maybe_write(lambda: progress("failed", lost), force=True, durable=True)
    line = headline(report)
    log.info(line)
    print(
        json.dumps(
            {"changed": True, "report": str(report_path), "headline": line, "lossless": report["lossless"]}
        )
    )
    return EXIT_OK if report["lossless"] else EXIT_FAILED_RECORDS


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def load_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object from a file, or None when it is missing, torn or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def exit_if_report_current(report_path: Path, digest: str, force: bool) -> int | None:
    """When the report at `report_path` was made from inputs with this digest (and --force is not given):
    print the unchanged result line the roles read and return the exit code; else None (evaluate)."""
    from ..evaluate.report import headline

    old = load_json_object(report_path)
    if not old or old.get("inputs_digest") != digest or force:
        return None
    log.info("report up to date", extra=kv(report=str(report_path)))
    result = {"changed": False, "report": str(report_path), "headline": headline(old)}
    print(json.dumps({**result, "lossless": old.get("lossless")}))
    return EXIT_OK if old.get("lossless") else EXIT_FAILED_RECORDS


if __name__ == "__main__":
    sys.exit(run_main(main, own_process=True))
