"""Regenerate the assistant turns of every prompt with the served target model (OpenAI-compatible API).

    python -m regen.jobs.generate --input PROMPTS.jsonl --output-dir DIR --endpoint URL [--endpoint URL ...]
        --model NAME --concurrency N --max-tokens N [--api-key-env VAR]

Input: the normalized prompt JSONL (`{"id", "conversations": [{"role", "content"}, ...]}`), a file, several
`--input`s, or the prompts job's output directory. Output in DIR:
  completions-NNNNN.jsonl  one object per prompt: id, conversations (assistant turns regenerated in order),
                           finish_reason, truncated, usage, latency, model and sampling provenance
  dropped-NNNNN.jsonl      truncated completions when `--truncated drop`
  errors.jsonl             prompts that failed in this run, with the reason (retried by the next run)
  superseded.jsonl         completions moved out of the output because their prompt was edited
                           ("superseded": generated again), left the set ("orphaned"), or were made
                           with other settings ("settings_changed", with --allow-config-change: generated
                           again); each listed once, never deleted
  ledger.bin, run.json     the id index that makes restarts exactly-once, and the generation settings
                           (a record is done when its id, prompt_key and settings_key match)
  status.json              progress, rewritten atomically every few seconds (the Ansible role polls it)
Exit codes: 0 every prompt done; 1 some prompts ended in errors.jsonl; 2 bad arguments or input (a
prompts shard that does not match its manifest, a damaged .gz, an API key the server refuses: HTTP
401/403 stops at once); 3 stopped because every endpoint stayed down longer than --max-outage; 4 crashed
(a bug: traceback on stderr); 5 the output cannot be written (a file in the way, read-only, disk full);
130/143 interrupted (SIGINT/SIGTERM: requests in flight get --stop-grace seconds). Every ending but a
SIGKILL leaves its state, exit_code and error in status.json, rewritten every --status-interval (pid and
updated_at tell a live job from a dead one: `regen.status.liveness`).

Kill it at any moment (SIGKILL included) and start it again with the same arguments: finished prompts are
skipped, a torn last line is repaired, nothing is lost or written twice (see `regen.jobs._ledger`).

The package, along the seams of the work: `rows` (pure logic: prompt rows, turn plans, responses),
`endpoints` (the endpoint pool), `job` (settings, the run loop, the dry run), `cli` (flags, `main`).
"""

from regen.jobs._common import EXIT_FAILED_RECORDS, EXIT_OK, EXIT_UNAVAILABLE
from regen.jobs.generate.cli import build_parser, main, settings_from_args
from regen.jobs.generate.endpoints import Endpoint, EndpointPool, EndpointsDown
from regen.jobs.generate.job import GenerateJob, Settings, Stats, dry_run
from regen.jobs.generate.rows import (
    BadRow,
    Completion,
    MalformedResponse,
    assistant_message,
    backoff_delay,
    normalize_endpoint,
    parse_completion,
    parse_prompt_row,
    parse_retry_after,
    resolve_inputs,
    turn_plan,
)

__all__ = [
    "EXIT_FAILED_RECORDS",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "BadRow",
    "Completion",
    "Endpoint",
    "EndpointPool",
    "EndpointsDown",
    "GenerateJob",
    "MalformedResponse",
    "Settings",
    "Stats",
    "assistant_message",
    "backoff_delay",
    "build_parser",
    "dry_run",
    "main",
    "normalize_endpoint",
    "parse_completion",
    "parse_prompt_row",
    "parse_retry_after",
    "resolve_inputs",
    "settings_from_args",
    "turn_plan",
]
