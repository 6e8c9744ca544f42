"""Issue 24's "done means": `regen facts --model-path` on the real Kimi K2.6 NVFP4 config, 8x 96 GiB sm_120.

The fixture is the checkpoint's own config.json and hf_quant_config.json, copied from the pinned
aiconfigurator-core wheel (tests/fixtures/configs/README.md: wheel, version, path, sha256).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regen.cli import main

ROOT = Path(__file__).resolve().parents[2]
K26 = ROOT / "tests" / "fixtures" / "configs" / "kimi-k2.6-nvfp4"
GIB = 1024**3


def test_regen_facts_on_the_real_kimi_k26_nvfp4_config(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["facts", "--model-path", str(K26), "--gpus", "8", "--gpu-memory-gib", "96",
            "--compute-capability", "12.0", "--prompt-rows", "100000", "--project", str(ROOT)]
    assert main([*argv, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    arch, plan = facts["architecture"], facts["plan_values"]
    # Weight bytes within 3% of 553 GiB (4.5-bit routed experts, bf16 for the rest, the vision tower counted).
    assert arch["weight_bytes_source"] == "estimate"
    assert arch["weight_bytes"] == pytest.approx(553 * GIB, rel=0.03)
    serving = plan["serving"]
    # The KV pool and the concurrency follow from them: 96 GiB x 0.84 - 554.3 GiB / 8 over 70,272 B/token.
    memory = serving["memory"]
    assert memory["weight_bytes"] == arch["weight_bytes"]
    assert memory["tokens"] == int((96 * GIB * serving["mem_fraction_static"] - arch["weight_bytes"] / 8)
                                   // 70272)
    assert plan["generation"]["concurrency"] == memory["tokens"] // plan["length"]["budget"]
    # The MoE table's flags for NVFP4 on sm_120, and the (backend, KV dtype) pair with its reason.
    assert (serving["quantization"], serving["moe_runner_backend"]) == ("modelopt_fp4", "flashinfer_cutlass")
    assert (serving["attention_backend"], serving["kv_cache_dtype"]) == ("flashinfer", "bf16")
    assert facts["plan"]["serving"]["kv_cache_dtype"]["pair"] == ["flashinfer", "bf16"]
    assert "to(q.dtype)" in facts["plan"]["serving"]["kv_cache_dtype"]["reason"]
    assert serving["cuda_graph_max_bs"] == -(-plan["generation"]["concurrency"] // 8) * 8
    # The NCCL decision for serving, capture and training, each with its reason; and the run estimate.
    assert set(plan["nccl"]) == {"serving", "capture", "training"}
    assert all(facts["plan"]["nccl"][k]["reason"] for k in plan["nccl"])
    run = plan["estimate"]["run"]
    assert run["generation"]["output_tokens"] == 100_000 * 4096
    assert run["disk"]["features_bytes"] == 100_000 * plan["length"]["budget"] * 6 * 7168 * 2

    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines at spaces
    for needle in ("weights: 554.3 GiB (estimate", "KV pool: ",
                   "--quantization modelopt_fp4 --moe-runner-backend flashinfer_cutlass",
                   "(attention backend, KV dtype): (flashinfer, bf16)", "NCCL serving:", "NCCL capture:",
                   "NCCL training:", "run estimate:", "409,600,000 output tokens"):
        assert needle in out, needle


def test_regen_facts_with_an_aiconfigurator_csv_shows_days(capsys: pytest.CaptureFixture[str]) -> None:
    # aiconfigurator 0.12.0's ranking recorded on this project's machine for Kimi K2.5 (K2.6's architecture)
    # on rtx_pro_6000_server: 369.496 output tokens/s for the plan's TP8/EP8 (rank 9).
    csv = ROOT / "tests" / "fixtures" / "aiconfigurator" / (
        "kimi-k2.5_rtx_pro_6000_server_agg_isl1024_osl4096.best_config_topn.csv")
    argv = ["facts", "--model-path", str(K26), "--gpus", "8", "--gpu-memory-gib", "96",
            "--compute-capability", "12.0", "--prompt-rows", "100000", "--simulation-csv", str(csv),
            "--project", str(ROOT)]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert "rank 9" in plan["serving"]["simulator_estimate"]["reason"]
    generation = plan["estimate"]["run"]["value"]["generation"]
    assert generation["seconds"] == pytest.approx(100_000 * 4096 / 369.496)
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "= 12 d 19 h" in out
    assert main([*argv[:-2], "--simulation-csv", str(K26 / "config.json"), "--project", str(ROOT)]) == 4
