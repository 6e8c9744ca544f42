"""Offline capture of the target's hidden states in SpecForge's DFlash feature format.

    python -m regen.training.capture --data TOKENIZED --model MODEL --layers 1,15,30,44,58 --output DIR
        [--backend hf|sglang] [--max-length N] [--max-samples N] [--dtype bfloat16] [--batch-tokens N]
        [--count-only] [--only ROUND.json]

Input: the tokenize stage's output, every `*.parquet` (columns `input_ids`, `loss_mask`) and every
`*.jsonl` whose records carry `input_ids` and `loss_mask`, in sorted file order. Output: one file per
sample, `DIR/data_<index>.ckpt`, holding what SpecForge 0.2.0's offline DFlash reader
(`dflash_family_data.normalize_offline_sample`) loads: `input_ids` [seq] int64, `loss_mask` [seq] int64
and `hidden_states` [seq, len(layers) * hidden] - the outputs of the listed target layers concatenated in
that order, which is what `extract_context_feature` feeds the drafter (`hidden_states[layer + 1]`).

Exactly once and resumable: a sample's file is written to a temporary name and renamed, so it exists
completely or not at all; a re-run skips the samples whose file exists. An empty file is a placeholder
(regen.training.rolling lays one for every sample of other rounds, so SpecForge lists the whole data set):
it counts as not captured. Each file written gets a line (its sha256 and size) in
`DIR.digests.jsonl` beside the directory; a file whose size is not the recorded one (cut short, or from
before the record) is captured again, and consumers check the sha256 before training reads it.
`--only FILE` captures only the samples a rolling round's file lists.
`DIR/capture_manifest.json` records the model, the layers, the dtype, the length limit and a digest of
the samples themselves (all of them, with `--only` too), and a re-run against different ones is refused
instead of mixing features. Samples SpecForge would reject (fewer than two consecutive supervised tokens
after truncation) are counted and skipped. Prints one JSON summary line; exit 2 means bad input, 5 the
features cannot be written (a full or read-only disk: the files written whole are kept, a re-run goes on).

Batched: samples are grouped by length (longest first) into forwards of at most `--batch-tokens` padded
tokens (0: one sample per forward). Rows are padded on the right, and a causal model's outputs at a position
never depend on later positions, so each sample's features are its first `len` rows of the batch's output,
the same as a forward of that sample alone (up to the kernels' floating-point order); the files stay one
per sample and are written as each batch finishes.

Backends: `hf` runs the target through transformers (`output_hidden_states`): the CPU path, and fine
for a target that fits one GPU. `sglang` uses SpecForge's own SGLang capture
(`specforge.offline_capture.OfflineSGLangCapture`, `set_capture_layers(..., capture_method="dflash")`) for
a model that needs tensor/expert parallelism: launch it under torchrun with one rank per GPU; rank 0
writes the files.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from regen.fsio import AtomicFile, atomic_write_json

MANIFEST = "capture_manifest.json"
EXIT_OUTPUT = 5


class CaptureError(Exception):
    """Bad input: the message says what and how to fix it."""


# --------------------------------------------------------------------------------------------------
# Reading the tokenized dataset
# --------------------------------------------------------------------------------------------------


def check_tokenize_finished(data: Path) -> None:
    """A tokenize output whose job did not finish (failed, interrupted, killed, or still running) is
    refused: its data/ may hold shards of the new input beside shards of the old one."""
    for directory in (data, data.parent) if data.name == "data" else (data,):
        path = directory / "status.json"
        if not path.is_file():
            continue
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = None
        if not isinstance(doc, dict):
            raise CaptureError(f"{path} is unreadable; run the tokenize stage again (--tags tokenize)")
        if doc.get("job") == "tokenize" and doc.get("state") != "done":
            error = f": {doc['error']}" if doc.get("error") else ""
            raise CaptureError(
                f"the tokenize job that writes {directory} did not finish (status.json: state "
                f"{doc.get('state')!r}{error}); its data may be half old, half new: run the tokenize stage "
                "again (--tags tokenize) until it finishes"
            )
        return


def _data_files(data: Path) -> list[Path]:
    if data.is_file():
        return [data]
    if not data.is_dir():
        raise CaptureError(
            f"tokenized data {data} does not exist; run the tokenize stage first (--tags tokenize)"
        )
    check_tokenize_finished(data)
    # The tokenize stage writes data/<shard>.parquet next to conversations and rejects JSONL files: when
    # there is Parquet, only Parquet holds samples; JSONL records with input_ids are the fallback format.
    parquet = sorted(p for p in data.rglob("*.parquet") if p.is_file())
    return parquet or sorted(p for p in data.rglob("*.jsonl") if p.is_file())


def iter_samples(data: str | Path) -> Iterator[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of every tokenized sample, in a stable order."""
    found = False
    for path in _data_files(Path(data)):
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if not {"input_ids", "loss_mask"} <= set(table.column_names):
                continue
            found = True
            ids_col, mask_col = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
            yield from zip(ids_col, mask_col, strict=True)
        else:
            with path.open(encoding="utf-8") as handle:
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise CaptureError(f"{path}:{number} is not JSON ({exc.msg})") from exc
                    if not isinstance(record, dict) or "input_ids" not in record:
                        break  # a conversations file, not tokenized records
                    found = True
                    yield record["input_ids"], record["loss_mask"]
    if not found:
        raise CaptureError(f"no tokenized samples (input_ids + loss_mask) under {data}")


def has_consecutive_supervised(mask: list[int]) -> bool:
    """SpecForge's DFlash reader needs two neighbouring supervised tokens (data/loss_mask.py)."""
    return any(a and b for a, b in itertools.pairwise(mask))


def select(
    data: str | Path, max_length: int, max_samples: int | None
) -> Iterator[tuple[int, list[int], list[int]]]:
    """(index, input_ids, loss_mask) of the samples to capture; the index is stable across re-runs."""
    kept = 0
    for index, (ids, mask) in enumerate(iter_samples(data)):
        if max_samples is not None and kept >= max_samples:
            return
        ids, mask = list(ids)[:max_length], list(mask)[:max_length]
        if len(ids) != len(mask):
            raise CaptureError(
                f"sample {index}: input_ids and loss_mask differ in length ({len(ids)} vs {len(mask)})"
            )
        if not has_consecutive_supervised(mask):
            yield index, [], []
            continue
        kept += 1
        yield index, ids, mask


class Fingerprint:
    """Digest of the selected samples in order: the identity of a feature directory's contents."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, index: int, ids: list[int], mask: list[int]) -> None:
        self._hash.update(array("q", [index, len(ids), *ids, *mask]).tobytes())

    def hexdigest(self) -> str:
        return self._hash.hexdigest()[:16]


def count(data: str | Path, max_length: int, max_samples: int | None) -> dict[str, Any]:
    samples = tokens = dropped = 0
    fingerprint = Fingerprint()
    for index, ids, mask in select(data, max_length, max_samples):
        if ids:
            samples += 1
            tokens += len(ids)
            fingerprint.add(index, ids, mask)
        else:
            dropped += 1
    return {"samples": samples, "tokens": tokens, "dropped": dropped, "fingerprint": fingerprint.hexdigest()}


# --------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------


class HFBackend:
    """transformers forward with output_hidden_states: hidden_states[layer + 1] is layer `layer`'s output."""

    def __init__(
        self, model: str, layers: list[int], dtype: str, device: str, trust_remote_code: bool
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.dtype = getattr(torch, dtype)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.model = (
            AutoModelForCausalLM.from_pretrained(model, trust_remote_code=trust_remote_code, dtype=self.dtype)
            .to(device)
            .eval()
        )
        self.layers = layers
        self.writer = True

    def capture(self, batch: list[list[int]]):
        """Features of each sample of `batch` ([len_i, layers * hidden] each), in one forward."""
        torch = self.torch
        input_ids, attention_mask = padded(torch, batch, self.device)
        with torch.no_grad():
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
            )
        states = out.hidden_states
        if max(self.layers) + 1 >= len(states):
            raise CaptureError(f"layer {max(self.layers)} is past the model's {len(states) - 1} layers")
        stacked = torch.cat([states[layer + 1] for layer in self.layers], dim=-1).to(self.dtype).cpu()
        return [stacked[row, : len(ids)] for row, ids in enumerate(batch)]


class SGLangBackend:
    """SpecForge's offline SGLang capture (tensor/expert parallel); one process per GPU under torchrun."""

    def __init__(
        self,
        model: str,
        layers: list[int],
        dtype: str,
        trust_remote_code: bool,
        server_kwargs: dict[str, Any],
    ) -> None:
        import torch
        from specforge.distributed import init_distributed
        from specforge.offline_capture import OfflineSGLangCapture

        self.torch = torch
        world = int(os.environ.get("WORLD_SIZE", "1"))
        init_distributed(timeout=60, tp_size=world)
        self.capturer = OfflineSGLangCapture.from_pretrained(
            model, torch_dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code, **server_kwargs
        )
        self.capturer.set_capture_layers(layers, capture_method="dflash")
        self.dtype = getattr(torch, dtype)
        self.writer = int(os.environ.get("RANK", "0")) == 0

    def capture(self, batch: list[list[int]]):
        torch = self.torch
        input_ids, attention_mask = padded(torch, batch, "cuda")
        # SpecForge makes one SGLang request per row (its pads included): causal, so a row's first len
        # outputs are the sample's own.
        result = self.capturer.capture(
            input_ids=input_ids, attention_mask=attention_mask, loss_mask=attention_mask
        )
        stacked = result.hidden_states.to(self.dtype).cpu()
        return [stacked[row, : len(ids)] for row, ids in enumerate(batch)]


def padded(torch, batch: list[list[int]], device: str):
    """Right-padded input_ids (pad id 0) and the attention mask of a batch of token lists."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    return input_ids.to(device), attention_mask.to(device)


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Positions of `lengths` grouped into forwards of at most `batch_tokens` padded tokens each.

    Longest first (ties in input order), so each batch holds samples of similar length and pads little; a
    sample longer than the budget goes alone. `batch_tokens` 0 means one sample per forward.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if batch_tokens <= 0:
        return [[i] for i in order]
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted longest first: the batch's first sample sets its padded width.
        width = lengths[current[0]] if current else lengths[i]
        if current and width * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def sample_path(output: Path, index: int) -> Path:
    return output / f"data_{index:08d}.ckpt"


def is_captured(
    path: Path, digests: dict[int, dict[str, Any]] | None = None, index: int | None = None
) -> bool:
    """A feature file with content. Files are written whole or not at all, so only an empty one (a
    rolling run's placeholder for a sample of another round) lacks features. With `digests` (the capture's
    record, `read_digests`), the file must also have the size recorded when it was written: a file cut
    short or grown since is not captured (its content digest is checked by `damaged`)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size <= 0:
        return False
    if digests is None:
        return True
    record = digests.get(int(index) if index is not None else -1)
    return bool(record) and int(record.get("bytes", -1)) == size


# The record of what the capture wrote: one JSON line per feature file (index, sha256, bytes), appended
# after the file is renamed into place, beside the feature directory (SpecForge lists every *.ckpt in it,
# and the rolling budget counts what is inside it). A file without a line (a kill between the rename and
# the append, or a file from before this record) is captured again.
DIGESTS_SUFFIX = ".digests.jsonl"


def digests_path(output: Path) -> Path:
    output = Path(output)
    return output.parent / (output.name + DIGESTS_SUFFIX)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def read_digests(output: Path) -> dict[int, dict[str, Any]]:
    """index -> {"sha256", "bytes"} of the last write of each sample (a torn last line is ignored)."""
    found: dict[int, dict[str, Any]] = {}
    try:
        text = digests_path(output).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return found
    for line in text.splitlines():
        try:
            row = json.loads(line)
            found[int(row["index"])] = {"sha256": str(row["sha256"]), "bytes": int(row["bytes"])}
        except (ValueError, KeyError, TypeError):
            continue
    return found


def record_digest(output: Path, index: int, path: Path) -> dict[str, Any]:
    row = {"index": int(index), "sha256": file_sha256(path), "bytes": path.stat().st_size}
    fd = os.open(digests_path(output), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(row, sort_keys=True) + "\n").encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    return row


def damaged(output: Path, indices: list[int], digests: dict[int, dict[str, Any]] | None = None) -> list[int]:
    """The samples among `indices` whose feature file has content that is not what the capture wrote
    (no record, another size, another sha256). Empty files and missing ones are not damaged: uncaptured."""
    digests = read_digests(output) if digests is None else digests
    bad = []
    for index in indices:
        path = sample_path(Path(output), index)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue
        if size == 0:
            continue
        record = digests.get(int(index))
        if not record or int(record["bytes"]) != size or record["sha256"] != file_sha256(path):
            bad.append(int(index))
    return bad


def read_only(path: str) -> set[int]:
    """The sample indices a `--only` file lists (JSON with an `indices` list: a rolling round's file)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        return {int(i) for i in doc["indices"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CaptureError(f"--only {path}: not a JSON object with an 'indices' list ({exc})") from None


def save_atomic(path: Path, payload: dict[str, Any]) -> int:
    import torch

    with AtomicFile(path) as out:
        torch.save(payload, out.file)
    return path.stat().st_size


def check_manifest(output: Path, manifest: dict[str, Any]) -> None:
    path = output / MANIFEST
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        keys = ("model", "layers", "dtype", "max_length", "data")
        if any(old.get(k) != manifest.get(k) for k in keys):
            differ = {k: (old.get(k), manifest.get(k)) for k in keys if old.get(k) != manifest.get(k)}
            raise CaptureError(
                f"{output} holds features captured with other settings {differ}; remove the directory or "
                "capture into a new one (drafter_training_hidden_states_dir)"
            )
    else:
        atomic_write_json(path, manifest)


def capture(args: argparse.Namespace) -> dict[str, Any]:
    layers = [int(x) for x in args.layers.split(",") if x.strip()]
    if not layers:
        raise CaptureError("--layers needs at least one target layer id")
    output = Path(args.output)
    manifest = {
        "model": os.path.abspath(args.model),
        "layers": layers,
        "dtype": args.dtype,
        "max_length": args.max_length,
        "format": "specforge DFlash offline v1 (input_ids, loss_mask, hidden_states)",
    }
    only = read_only(args.only) if args.only else None
    digests = read_digests(output)
    todo = []
    summary = {"samples": 0, "written": 0, "skipped": 0, "dropped": 0, "tokens": 0, "bytes": 0}
    fingerprint = Fingerprint()
    kept = set()
    for index, ids, mask in select(args.data, args.max_length, args.max_samples):
        if not ids:
            summary["dropped"] += 1
            continue
        fingerprint.add(index, ids, mask)
        kept.add(index)
        if only is not None and index not in only:
            continue
        summary["samples"] += 1
        summary["tokens"] += len(ids)
        if is_captured(sample_path(output, index), digests, index):
            summary["skipped"] += 1
        else:
            todo.append((index, ids, mask))
    if only is not None:
        unknown = sorted(only - kept)
        if unknown:
            raise CaptureError(
                f"{args.only} lists {len(unknown)} sample(s) the data does not have (first: {unknown[0]}): "
                "the tokenized data changed since the list was made; plan the rounds again (re-run the train "
                "stage)"
            )
        summary["selected"] = len(kept)
    # Features belong to exactly this data: a directory captured from other samples is never reused.
    manifest["data"] = summary["fingerprint"] = fingerprint.hexdigest()
    if not todo:
        if summary["samples"]:
            check_manifest(output, manifest)
        return summary
    check_manifest(output, manifest)
    import torch

    if args.backend == "hf":
        backend = HFBackend(args.model, layers, args.dtype, args.device, not args.no_trust_remote_code)
    else:
        server_kwargs = json.loads(args.sglang_args or "{}")
        backend = SGLangBackend(args.model, layers, args.dtype, not args.no_trust_remote_code, server_kwargs)
    started = time.monotonic()
    number = 0
    summary["forwards"] = 0
    for positions in plan_batches([len(ids) for _, ids, _ in todo], args.batch_tokens):
        batch = [todo[i] for i in positions]
        features = backend.capture([ids for _, ids, _ in batch])
        summary["forwards"] += 1
        for (index, ids, mask), hidden in zip(batch, features, strict=True):
            number += 1
            if backend.writer:
                payload = {
                    "input_ids": torch.tensor(ids, dtype=torch.long),
                    "loss_mask": torch.tensor(mask, dtype=torch.long),
                    "hidden_states": hidden.clone(),  # its own storage, not a view of the whole batch
                }
                summary["bytes"] += save_atomic(sample_path(output, index), payload)
                record_digest(output, index, sample_path(output, index))
                summary["written"] += 1
            if args.progress and (number % args.progress == 0 or number == len(todo)):
                rate = number / max(1e-9, time.monotonic() - started)
                print(f"captured {number}/{len(todo)} ({rate:.1f} samples/s)", file=sys.stderr, flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.capture", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--data", required=True, help="tokenized dataset (dir of *.parquet / *.jsonl, or a file)"
    )
    parser.add_argument("--model", help="target model directory (not needed with --count-only)")
    parser.add_argument("--layers", default="", help="comma-separated target layer ids, e.g. 1,15,30,44,58")
    parser.add_argument("--output", help="directory of the feature files")
    parser.add_argument("--backend", choices=("hf", "sglang"), default="hf")
    parser.add_argument("--device", default="auto", help="hf backend: cpu, cuda or auto")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=0,
        help="padded tokens per forward, samples grouped by length (0: one sample per forward)",
    )
    parser.add_argument("--sglang-args", default=None, help='JSON of SGLang ServerArgs, e.g. {"ep_size": 8}')
    parser.add_argument("--no-trust-remote-code", action="store_true")
    parser.add_argument("--progress", type=int, default=0, help="print progress every N samples (stderr)")
    parser.add_argument("--count-only", action="store_true", help="only count samples and tokens")
    parser.add_argument(
        "--only",
        default=None,
        help="JSON file whose 'indices' list names the samples to capture (a rolling round); the manifest "
        "still identifies the whole data set",
    )
    args = parser.parse_args(argv)
    try:
        if args.count_only:
            result = count(args.data, args.max_length, args.max_samples)
        else:
            if not (args.model and args.output and args.layers):
                parser.error("--model, --layers and --output are required unless --count-only")
            result = capture(args)
    except CaptureError as exc:
        print(json.dumps({"failed": True, "msg": str(exc)}))
        return 2
    except OSError as exc:
        from regen.jobs._common import describe_os_error

        described = describe_os_error(exc)
        if described is None:
            raise
        # A full disk (or a read-only one) mid-capture: what was written whole stays, the torn file is
        # never renamed into place, and the next run captures the rest.
        print(json.dumps({"failed": True, "msg": f"cannot write the features: {described}"}))
        return EXIT_OUTPUT
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
