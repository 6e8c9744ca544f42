"""Check a SpecForge run config and DFlash draft config with SpecForge's own code, before any launch.

    python -m regen.training.validate [--run-config run.yaml [--node-rank N]] [--draft-config config.json]

Runs inside the training venv (SpecForge 0.2.0 installed). The run config goes through exactly what
`specforge train` does first: `specforge.config.load_config` (the pydantic schema, strict: unknown keys
fail), `specforge.application.resolve_run` (the algorithm registry) and
`specforge.launch_plan.build_launch_plan` (the process topology: the torchrun command SpecForge will
spawn). The draft config goes through `specforge.training.model_loading.load_draft_config_source` (the
draft registry and Qwen3Config) and is instantiated as SpecForge's `DFlashDraftModel` on the meta device,
which checks every shape without allocating weights. Prints one JSON object; exit 1 when a check fails
(the message is SpecForge's), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def check_run_config(path: str, node_rank: int | None) -> dict[str, Any]:
    from specforge.application import resolve_run
    from specforge.config import load_config
    from specforge.launch_plan import build_launch_plan

    config = load_config(path)
    resolved = resolve_run(config)
    # An empty environment: the plan must not depend on RANK/WORLD_SIZE of whoever runs the check.
    plan = build_launch_plan(
        resolved.config,
        algorithm=resolved.algorithm,
        config_path=path,
        requested_role="auto",
        node_rank=node_rank,
        env={},
    )
    return {
        "mode": config.mode,
        "strategy": config.training.strategy,
        "deployment": config.deployment.mode,
        "run_id": config.run_id,
        "launch_plan": json.loads(plan.render()),
    }


def check_draft_config(path: str) -> dict[str, Any]:
    import torch
    from specforge.modeling.draft.dflash import DFlashDraftModel, resolve_dflash_attention_layout
    from specforge.training.model_loading import load_draft_config_source

    config = load_draft_config_source(path)
    resolve_dflash_attention_layout(config)
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    ids = list(model.target_layer_ids)
    expected_fc = len(ids) * config.hidden_size
    if model.fc.in_features != expected_fc:
        raise ValueError(f"draft fc takes {model.fc.in_features} features, expected {expected_fc}")
    if model.mask_token_id is None or not 0 <= int(model.mask_token_id) < config.vocab_size:
        raise ValueError(
            f"mask_token_id {model.mask_token_id} is not inside the vocabulary {config.vocab_size}"
        )
    return {
        "architecture": type(model).__name__,
        "target_layer_ids": ids,
        "block_size": model.block_size,
        "mask_token_id": model.mask_token_id,
        "fc_in_features": model.fc.in_features,
        "num_hidden_layers": config.num_hidden_layers,
        "num_target_layers": config.num_target_layers,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.validate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--run-config", help="SpecForge run YAML")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node runs)")
    parser.add_argument("--draft-config", help="DFlash draft config.json")
    args = parser.parse_args(argv)
    if not (args.run_config or args.draft_config):
        parser.error("give --run-config and/or --draft-config")
    result: dict[str, Any] = {"ok": True}
    try:
        if args.draft_config:
            result["draft"] = check_draft_config(args.draft_config)
        if args.run_config:
            result["run"] = check_run_config(args.run_config, args.node_rank)
    except Exception as exc:  # SpecForge raises ValueError, pydantic ValidationError, FileNotFoundError, ...
        result = {"ok": False, "error_type": type(exc).__name__, "msg": str(exc)}
        print(json.dumps(result, sort_keys=True))
        return 1
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
