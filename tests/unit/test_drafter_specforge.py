"""regen's drafter and run configs against SpecForge 0.2.0 itself (its pydantic schema, draft registry,
DFlash model class and launch planner), installed from PyPI into a throwaway venv.

The venv (.cache/specforge-0.2.0-venv, built on first use in ~10 s, reused after) is layered on this
interpreter's site-packages: it holds SpecForge 0.2.0 (--no-deps: its sglang/flash-attn/CUDA pins are not
needed to import its config, model and launch-planning code) and the transformers release SpecForge pins
(5.8.1, with the hub/tokenizers versions that release needs), while torch 2.13.0 (CPU), pydantic and
PyYAML come from the project venv. Every check runs in one subprocess to pay the imports once.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from ansible.module_utils import regen_drafter as d
from ansible.module_utils.regen_families import FAMILIES
from ansible.module_utils.regen_plan import dflash_target_layer_ids

from tests.helpers.specforge_venv import PINS, specforge_python

FIXTURES = ROOT / "tests" / "fixtures" / "drafter"
# The venv and its pins live in tests/helpers/specforge_venv.py (shared with the online-training tests).
assert PINS[0] == "specforge==0.2.0"


def _venv_python() -> Path:
    return specforge_python()


DRIVER = r"""
import json, sys
from regen.training.validate import check_draft_config, check_run_config
from specforge.modeling.draft.dflash import build_target_layer_ids
from specforge.data.template import TEMPLATE_REGISTRY
import transformers, specforge.config
out = {"transformers": transformers.__version__, "spread": {}, "cases": {},
       "templates": sorted(TEMPLATE_REGISTRY.get_all_template_names())}
for layers in range(2, 131):
    for draft in range(1, 11):
        out["spread"][f"{layers}/{draft}"] = build_target_layer_ids(layers, draft)
for name, kind, path, rank in json.load(open(sys.argv[1])):
    try:
        out["cases"][name] = {"ok": True, "result": check_draft_config(path) if kind == "draft"
                              else check_run_config(path, rank)}
    except Exception as exc:
        out["cases"][name] = {"ok": False, "error": type(exc).__name__, "msg": str(exc)}
# The rolling executor's view of SpecForge's offline sampler against torch's DistributedSampler, which
# SpecForge says it reproduces (launch._shard_offline_refs): every rank, every epoch, padding included.
from torch.utils.data import DistributedSampler
from regen.training.rolling import sampler_orders
out["orders"] = {}
for size, world, seed, epochs in ((8, 1, 42, 1), (5, 2, 42, 2), (13, 4, 7, 3)):
    theirs = []
    for epoch in range(epochs):
        ranks = []
        for rank in range(world):
            sampler = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            ranks.append(list(sampler))
        theirs.append(ranks)
    out["orders"][f"{size}/{world}/{seed}/{epochs}"] = [sampler_orders(size, world, seed, epochs), theirs]
# regen.training.online_launch's plan (--plan starts nothing) for the online config, and its refusal of
# an offline one: SpecForge's own planner underneath, the consumer's command replaced.
import contextlib, io
from regen.training import online_launch
out["online_launch"] = {}
for name, kind, path, rank in json.load(open(sys.argv[1])):
    if name in ("run:online", "run:cpu"):
        printed, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            code = online_launch.main(["--host", "127.0.0.1", "--port", "29511", "--plan", "--",
                                       "--config", path])
        out["online_launch"][name] = {"code": code, "stdout": printed.getvalue(), "stderr": errors.getvalue()}
print(json.dumps(out))
"""


def _kimi_facts() -> dict:
    from ansible.module_utils import (
        regen_config,  # the introspection helper's parser, as the pipeline uses it
    )

    config = json.loads((FIXTURES / "targets" / "kimi-k2.6" / "config.json").read_text())
    return {
        "architecture": regen_config.normalize_config(config),
        "tokenizer": {"mask_token": {"id": 163838}},
    }


def _run_config(tmp: Path, mode: str = "offline", nnodes: int = 1, gpus: int = 1, **kw) -> dict:
    topology = {"nnodes": nnodes, "node_rank": 0, "nproc_per_node": gpus, "master_port": 29500}
    return d.specforge_run_config(
        model_path="/models/Kimi-K2.6",
        draft_config_path=str(FIXTURES / "golden" / "kimi-k2.6.json"),
        embedding_key="language_model.model.embed_tokens.weight",
        lm_head_key="language_model.lm_head.weight",
        mask_token_id=163838,
        mode=mode,
        run_id="dflash-test",
        output_dir=str(tmp / "out"),
        cache_dir=str(tmp / "cache"),
        topology=topology,
        master_addr="10.0.0.1",
        hidden_states_path=str(tmp / "hs"),
        prompts_path=str(tmp / "prompts.jsonl"),
        chat_template="kimi-k2-thinking",
        training={
            "learning_rate": 6e-4,
            "attention_backend": "flex_attention",
            "max_steps": 100,
            "fsdp_sharding": "SHARD_GRAD_OP",
            "save_interval": 50,
            "log_interval": 10,
        },
        **kw,
    )


@pytest.fixture(scope="module")
def specforge(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("specforge")
    cases = []
    for golden in sorted((FIXTURES / "golden").glob("*.json")):
        cases.append((f"draft:{golden.stem}", "draft", str(golden), None))
    broken = json.loads((FIXTURES / "golden" / "qwen3-8b.json").read_text())
    broken["layer_types"] = ["full_attention"] * 3  # 5 layers, 3 layer types
    (tmp / "broken.json").write_text(json.dumps(broken))
    cases.append(("draft:broken", "draft", str(tmp / "broken.json"), None))
    runs = {
        "run:cpu": _run_config(tmp),
        "run:ct200": _run_config(tmp, gpus=8),
        "run:two-nodes": _run_config(tmp, nnodes=2, gpus=8),
        "run:online": _run_config(
            tmp,
            mode="online",
            gpus=8,
            online={
                "server_urls": ["http://127.0.0.1:30000"],
                "mooncake": {
                    "master_server_addr": "127.0.0.1:50051",
                    "metadata_server": "http://127.0.0.1:8080/metadata",
                    "local_hostname": "127.0.0.1",
                    "protocol": "tcp",
                },
            },
        ),
        "run:typo": _run_config(tmp, extra={"training": {"learning_rat": 1e-4}}),
        # A rolling run: the whole run's horizon in training.total_steps, each round's stop in max_steps.
        "run:rolling": _run_config(tmp, gpus=8, extra={"training": {"total_steps": 400}}),
    }
    import yaml

    for name, config in runs.items():
        path = tmp / f"{name.split(':')[1]}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        cases.append((name, "run", str(path), 1 if name == "run:two-nodes" else None))
    # SpecForge's own offline DFlash example: the reference shape our run configs follow.
    cases.append(
        ("run:specforge-example", "run", str(FIXTURES / "specforge" / "qwen3.5-4b-dflash-offline.yaml"), None)
    )
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [str(_venv_python()), "-c", DRIVER, str(tmp / "cases.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_venv_runs_specforges_pinned_transformers(specforge: dict) -> None:
    assert specforge["transformers"] == "5.8.1"


def test_every_family_template_is_registered_in_specforge(specforge: dict) -> None:
    # The registry's SpecForge column (and the fallback) must name templates SpecForge 0.2.0 registers.
    names = {row.specforge_chat_template for row in FAMILIES.values() if row.specforge_chat_template}
    names.add(d.DEFAULT_SPECFORGE_CHAT_TEMPLATE)
    assert "kimi-k2-thinking" in specforge["templates"]  # the list is SpecForge's real registry
    assert names - set(specforge["templates"]) == set()


def test_our_layer_spread_is_specforges(specforge: dict) -> None:
    for key, theirs in specforge["spread"].items():
        layers, draft = map(int, key.split("/"))
        assert dflash_target_layer_ids(layers, draft) == theirs, key


@pytest.mark.parametrize(
    ("name", "layers", "ids"),
    [
        ("kimi-k2.6", 61, [1, 12, 24, 35, 47, 58]),
        ("qwen3-8b", 36, [1, 9, 17, 25, 33]),
        ("deepseek-v3", 61, [1, 15, 30, 44, 58]),
    ],
)
def test_golden_drafters_build_as_specforge_models(
    specforge: dict, name: str, layers: int, ids: list
) -> None:
    case = specforge["cases"][f"draft:{name}"]
    assert case["ok"], case
    golden = json.loads((FIXTURES / "golden" / f"{name}.json").read_text())
    result = case["result"]
    assert result["architecture"] == "DFlashDraftModel"
    assert result["target_layer_ids"] == ids and result["num_target_layers"] == layers
    assert result["fc_in_features"] == len(ids) * golden["hidden_size"]
    assert result["mask_token_id"] == golden["dflash_config"]["mask_token_id"]
    assert result["block_size"] == golden["block_size"]


def test_specforge_rejects_an_inconsistent_draft(specforge: dict) -> None:
    case = specforge["cases"]["draft:broken"]
    assert not case["ok"] and "number of layer types (3)" in case["msg"]


def test_run_configs_pass_specforges_schema_and_launch_planner(specforge: dict) -> None:
    cpu = specforge["cases"]["run:cpu"]
    assert cpu["ok"], cpu
    assert cpu["result"]["mode"] == "offline" and cpu["result"]["launch_plan"]["kind"] == "worker"
    ct200 = specforge["cases"]["run:ct200"]
    assert ct200["ok"], ct200
    argv = ct200["result"]["launch_plan"]["commands"][0]["argv"]
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert argv[3:6] == ["--standalone", "--nproc_per_node", "8"]
    # SpecForge runs itself under torchrun: `-m torch.distributed.run ... --module specforge.cli train`.
    assert argv[6:] == ["--module", "specforge.cli", "train", "--config", argv[10], "--role", "all"]
    two = specforge["cases"]["run:two-nodes"]
    assert two["ok"], two
    argv = two["result"]["launch_plan"]["commands"][0]["argv"]
    joined = " ".join(argv)
    assert "--nnodes 2 --node_rank 1 --master_addr 10.0.0.1 --master_port 29500 --nproc_per_node 8" in joined


def test_a_rolling_run_config_keeps_the_horizon_apart_from_the_stop(specforge: dict) -> None:
    rolling = specforge["cases"]["run:rolling"]
    assert rolling["ok"], rolling
    assert rolling["result"]["launch_plan"]["kind"] != "worker"  # 8 ranks under torchrun, like run:ct200


def test_rolling_rounds_follow_specforges_sampler(specforge: dict) -> None:
    for case, (ours, theirs) in specforge["orders"].items():
        assert ours == theirs, case
    # The demo's eight samples with seed 42: the order the rolling train-stage test's rounds split.
    assert specforge["orders"]["8/1/42/1"][0] == [[[6, 3, 0, 7, 2, 1, 4, 5]]]
    # Five samples on two ranks: padded to six with the epoch order's first sample again.
    for epoch in specforge["orders"]["5/2/42/2"][0]:
        assert len(epoch[0]) == len(epoch[1]) == 3


def test_our_offline_config_has_the_shape_of_specforges_example(specforge: dict, tmp_path: Path) -> None:
    import yaml

    example = specforge["cases"]["run:specforge-example"]
    assert example["ok"], example
    reference = yaml.safe_load((FIXTURES / "specforge" / "qwen3.5-4b-dflash-offline.yaml").read_text())
    ours = _run_config(tmp_path, gpus=8)
    assert set(ours) == set(reference)
    assert example["result"]["mode"] == specforge["cases"]["run:ct200"]["result"]["mode"] == "offline"
    assert ours["training"]["strategy"] == reference["training"]["strategy"] == "dflash"
    assert ours["deployment"]["mode"] == reference["deployment"]["mode"] == "local_colocated"


def test_online_config_is_a_disaggregated_mooncake_run(specforge: dict) -> None:
    online = specforge["cases"]["run:online"]
    assert online["ok"], online
    assert online["result"]["mode"] == "online" and online["result"]["deployment"] == "disaggregated"
    plan = online["result"]["launch_plan"]
    assert plan["role"] == "both", plan
    assert [c["label"] for c in plan["commands"]] == ["producer", "consumer"]
    consumer = plan["commands"][1]
    assert "torch.distributed.run" in consumer["argv"] and consumer["argv"][-2:] == ["--role", "consumer"]


def test_online_launch_keeps_specforges_plan_and_puts_the_consumer_under_the_rendezvous(
    specforge: dict,
) -> None:
    theirs = specforge["cases"]["run:online"]["result"]["launch_plan"]
    launch = specforge["online_launch"]["run:online"]
    assert launch["code"] == 0, launch["stderr"]
    ours = json.loads(launch["stdout"])
    assert (ours["kind"], ours["role"]) == (theirs["kind"], theirs["role"]) == ("supervisor", "both")
    # The producer is SpecForge's, untouched; so is the consumer's environment.
    assert ours["commands"][0] == theirs["commands"][0]
    consumer = ours["commands"][1]
    assert consumer["env"] == theirs["commands"][1]["env"]
    # The consumer's 8 ranks: regen's rendezvous holds the store on loopback, not torchrun --standalone.
    argv = consumer["argv"]
    assert "torch.distributed.run" not in argv and "--standalone" not in argv
    assert argv[1:12] == [
        "-m", "regen.training.rendezvous", "--host", "127.0.0.1", "--port", "29511", "--nproc", "8", "--",
        "specforge.cli", "train",
    ]  # fmt: skip
    assert argv[-2:] == ["--role", "consumer"]


def test_online_launch_refuses_an_offline_config(specforge: dict) -> None:
    launch = specforge["online_launch"]["run:cpu"]
    assert launch["code"] == 2 and launch["stdout"] == ""
    assert "regen.training.online_launch: --role producer/consumer/both requires disaggregated mode" in (
        launch["stderr"]
    )


def test_specforge_rejects_a_misspelled_setting(specforge: dict) -> None:
    case = specforge["cases"]["run:typo"]
    assert not case["ok"] and case["error"] == "ValidationError" and "learning_rat" in case["msg"]


def test_online_without_a_capture_server_is_refused(tmp_path: Path) -> None:
    with pytest.raises(d.DrafterPlanError, match="drafter_training_online_server_urls"):
        _run_config(tmp_path, mode="online")


def test_kimi_facts_make_the_golden(tmp_path: Path) -> None:
    config, _, _ = d.draft_config(
        _kimi_facts(), json.loads((FIXTURES / "targets" / "kimi-k2.6" / "config.json").read_text())
    )
    assert config == json.loads((FIXTURES / "golden" / "kimi-k2.6.json").read_text())


@pytest.mark.parametrize("name", ["kimi-k2.6", "qwen3-8b", "deepseek-v3"])
def test_the_trainer_memory_plan_counts_specforges_parameters(specforge: dict, name: str) -> None:
    """The topology plan sizes trainer GPUs from a parameter count: it must be SpecForge's own model's."""
    from ansible.module_utils.regen_training_topology import draft_parameters

    golden = json.loads((FIXTURES / "golden" / f"{name}.json").read_text())
    case = specforge["cases"][f"draft:{name}"]
    assert case["ok"], case
    assert draft_parameters(golden)["trainable"] == case["result"]["parameters"]
