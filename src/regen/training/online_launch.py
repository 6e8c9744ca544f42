"""Run SpecForge's online (disaggregated) training on one host with the trainers' store on one address.

    python -m regen.training.online_launch --host 127.0.0.1 --port 29500 [--plan] \
        -- --config run.yaml [OVERRIDES]

Why: `specforge train` without `--role` (SpecForge 0.2.0's `both`) supervises a producer and a consumer,
and starts the consumer's trainer ranks itself: one rank in a process that picks a random port on
``MASTER_ADDR=127.0.0.1``, several under ``torchrun --standalone``. Either way torch's TCPStore listens on
every interface, unauthenticated, for the whole run. SpecForge refuses ``--role both`` inside an existing
torch environment, so regen.training.rendezvous cannot simply wrap it.

This module keeps SpecForge's own plan and supervisor (``specforge.launch_plan.build_launch_plan`` and
``run_commands``: the producer and consumer environments, the checks of the control and consumer-state
directories, the first failure stopping the other process, the shutdown grace), and changes one thing:
the consumer's command runs under regen.training.rendezvous, which holds the store on ``--host:--port``
and gives the ranks the ``env://`` contract (``--role consumer``, as SpecForge requires there). The producer
owns no process group and is left as SpecForge starts it.

``--plan`` prints the resolved plan (SpecForge's own rendering, secrets redacted) and starts nothing.

Exit codes: SpecForge's supervisor's (0 both succeeded; the first failure's code; 128+N after signal N);
2 the config cannot be launched this way (the message says why).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any


def consumer_argv(
    python: str, host: str, port: int, nproc: int, config_path: str, overrides: list[str]
) -> list[str]:
    """The consumer's command: SpecForge's consumer ranks under regen.training.rendezvous."""
    return [
        python,
        "-m",
        "regen.training.rendezvous",
        "--host",
        host,
        "--port",
        str(port),
        *(["--nproc", str(nproc)] if nproc > 1 else []),
        "--",
        "specforge.cli",
        "train",
        "--config",
        config_path,
        "--role",
        "consumer",
        *overrides,
    ]


def rendezvous_plan(plan: Any, consumer: list[str]) -> Any:
    """SpecForge's producer + consumer plan with the consumer's command replaced by ``consumer``.

    Refuses (ValueError) plans that are not SpecForge's plain two-process supervisor: a managed_local
    stack is regen's to start, not SpecForge's, and anything else has no consumer to wrap.
    """
    if plan.kind != "supervisor" or plan.role != "both":
        raise ValueError(
            f"SpecForge planned a {plan.kind!r} launch with role {plan.role!r}; "
            "regen.training.online_launch runs the producer + consumer supervisor of an online run "
            "on one trainer host (no managed_local stack)"
        )
    labels = [command.label for command in plan.commands]
    if labels != ["producer", "consumer"]:
        raise ValueError(f"SpecForge planned the commands {labels}, not a producer and a consumer")
    producer, planned = plan.commands
    return replace(plan, commands=(producer, replace(planned, argv=tuple(consumer))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.online_launch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", required=True, help="the address the trainers' store binds")
    parser.add_argument("--port", type=int, required=True, help="the store's port (0: any free port)")
    parser.add_argument("--plan", action="store_true", help="print the resolved plan, start nothing")
    parser.add_argument(
        "specforge_args", nargs=argparse.REMAINDER, help="after --: --config FILE [OVERRIDES]"
    )
    args = parser.parse_args(argv)
    rest = args.specforge_args[1:] if args.specforge_args[:1] == ["--"] else args.specforge_args
    if len(rest) < 2 or rest[0] not in ("--config", "-c"):
        parser.error("give SpecForge's run config after --: -- --config FILE [OVERRIDES]")
    config_path, overrides = rest[1], rest[2:]

    # SpecForge's own loaders, so the plan is the one `specforge train` would make.
    from specforge.application import resolve_run
    from specforge.config import load_config
    from specforge.launch_plan import build_launch_plan, run_commands

    try:
        resolved = resolve_run(load_config(config_path, overrides))
        plan = build_launch_plan(
            resolved.config,
            algorithm=resolved.algorithm,
            config_path=config_path,
            overrides=overrides,
            requested_role="both",
        )
        nproc = resolved.config.deployment.trainer.nproc_per_node
        plan = rendezvous_plan(
            plan, consumer_argv(sys.executable, args.host, args.port, nproc, config_path, overrides)
        )
    except ValueError as exc:
        print(f"regen.training.online_launch: {exc}", file=sys.stderr)
        return 2
    if args.plan:
        print(plan.render())
        return 0
    return run_commands(plan)


if __name__ == "__main__":
    raise SystemExit(main())
