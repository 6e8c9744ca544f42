"""SGLang's own serving benchmark for the sweep where SGLang serves: its command line and its dataset.

SGLang 0.5.23 moved `python -m sglang.bench_serving` to `python -m sglang.benchmark.serving` (the old path
still works and warns). The sweep gives it the same request mix the regen client sends elsewhere: the
prompts' first user turns as a ShareGPT-format file (bench_serving reads `conversations[0..1].value`
and keeps the first two turns), every answer capped at the same `max_tokens` (`--sharegpt-output-len`),
through the OpenAI chat route (`--backend sglang-oai-chat`) so the server's chat template applies as it
does for the generate job. One run per concurrency (`--max-concurrency`, all requests sent at once:
`--request-rate inf`), each appending one JSON record to `--output-file`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODULE = "sglang.benchmark.serving"


def sharegpt_rows(messages_list: Sequence[Sequence[dict[str, str]]]) -> list[dict[str, Any]]:
    """The request mix as bench_serving's ShareGPT rows: the last user turn, and a stand-in answer.

    bench_serving skips rows with fewer than two turns and reads the second only for its length, which
    `--sharegpt-output-len` overrides, so the stand-in is never sent.
    """
    rows = []
    for index, messages in enumerate(messages_list):
        user = [m["content"] for m in messages if m.get("role") == "user"]
        if not user:
            continue
        rows.append(
            {
                "id": f"regen-{index}",
                "conversations": [
                    {"from": "human", "value": user[-1]},
                    {"from": "gpt", "value": "(answer length set by the sweep)"},
                ],
            }
        )
    return rows


def write_dataset(path: Path, messages_list: Sequence[Sequence[dict[str, str]]]) -> int:
    rows = sharegpt_rows(messages_list)
    path.write_text(json.dumps(rows, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return len(rows)


def bench_serving_argv(
    *,
    python: str,
    base_url: str,
    served_model: str,
    tokenizer: str,
    dataset: str,
    num_prompts: int,
    max_tokens: int,
    concurrency: int,
    output_file: str,
    seed: int = 0,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The bench_serving command line for one concurrency level (validated by SGLang 0.5.23's parser in the
    tests). `--ready-check-timeout-sec 0`: the sweep has already waited for readiness and the quality
    gate, and bench_serving's own probe would send an extra request into the measurement."""
    if concurrency < 1 or num_prompts < 1 or max_tokens < 4:
        # bench_serving itself refuses an output length below 4 ("output_len too small").
        raise ValueError("concurrency and num_prompts must be >= 1 and max_tokens >= 4 for bench_serving")
    return [
        python,
        "-m",
        MODULE,
        "--backend",
        "sglang-oai-chat",
        "--base-url",
        base_url,
        "--model",
        served_model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        dataset,
        "--num-prompts",
        str(num_prompts),
        "--sharegpt-output-len",
        str(max_tokens),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--ready-check-timeout-sec",
        "0",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--output-file",
        output_file,
        *extra_args,
    ]


def read_results(path: Path) -> list[dict[str, Any]]:
    """The JSON records bench_serving appended to its --output-file (one per run)."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not JSON ({exc})") from None
    return records
