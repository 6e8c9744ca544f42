"""The end-of-run summary reads whatever artifacts exist and never fails a run."""

from __future__ import annotations

import json
from pathlib import Path

from ansible.module_utils.regen_plan import plan_values

from regen import summary
from regen.training.status import new_status


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


FACTS = {
    "architecture": {
        "model_type": "kimi_k25",
        "text_model_type": "kimi_k2",
        "num_layers": 61,
        "hidden_size": 7168,
        "vocab_size": 163840,
        "attention": {"kind": "mla"},
        "moe": {"routed_experts": 384, "experts_per_token": 8, "shared_experts": 1, "dense_prefix_layers": 1},
    },
    "tokenizer": {"loaded_with": "raw_files", "load": {"remedy": "tiktoken is not installed in /v; add it"}},
    "plan": {
        "serving": {
            "tp_size": {"value": 8, "reason": "fits"},
            "ep_size": {"value": 8},
            "device": {"value": "cuda"},
        },
        "drafter": {"target_layer_ids": {"value": [1, 15, 30, 44, 58]}, "block_size": {"value": 16}},
        "generation": {"thinking_switch": {"value": "thinking"}, "concurrency": {"value": 25}},
        "length": {
            "prompt_set": {"value": {"method": "tokens"}},
            "prompt_tokens": {"value": 1830},
            "max_tokens": {"value": 4096},
            "budget": {"value": 5934},
        },
    },
}
FACTS["plan_values"] = plan_values(FACTS["plan"])  # as model_plan_info adds it to the facts document


def test_empty_artifacts_say_so(tmp_path: Path) -> None:
    assert "no stage has recorded anything" in summary.render(summary.collect(tmp_path), tmp_path)


def test_facts_become_model_tokenizer_and_plan_rows(tmp_path: Path) -> None:
    _write(tmp_path / "model_facts.json", FACTS)
    rows = dict(summary.collect(tmp_path))
    assert "61 layers" in rows["model"] and "MoE 384 experts top-8 (+1 shared" in rows["model"]
    assert "raw_files" in rows["tokenizer"] and "tiktoken is not installed" in rows["tokenizer"]
    assert "tp=8 ep=8 on cuda" in rows["plan"] and "[1, 15, 30, 44, 58]" in rows["plan"]
    assert rows["budget"] == (
        "5934 tokens per sequence (longest prompt 1830 tokens, counted; max_tokens 4096 per turn); "
        "25 requests in flight"
    )


def test_facts_from_before_plan_values_say_to_reintrospect(tmp_path: Path) -> None:
    _write(tmp_path / "model_facts.json", {k: v for k, v in FACTS.items() if k != "plan_values"})
    rows = dict(summary.collect(tmp_path))
    assert "re-run the introspect stage" in rows["plan"] and "61 layers" in rows["model"]


def test_stage_records_are_listed_per_host(tmp_path: Path) -> None:
    _write(tmp_path / "completions" / "status-gpu1.json", {"done": 10, "failed": 2, "latency_p50_s": 1.5})
    _write(tmp_path / "tokenized" / "stats.json", {"samples": 10, "tokens": 900, "supervised_fraction": 0.5})
    training = new_status(total_steps=8)  # the training launcher's document, as the role keeps it
    training.update(state="succeeded", done=8, loss=7.5)
    _write(tmp_path / "drafter" / "gpu1" / "status.json", training)
    rows = summary.collect(tmp_path)
    text = summary.render(rows, tmp_path)
    assert "gpu1: succeeded, step 8/8, loss 7.5000" in text
    assert "gpu1: 10 done, 2 failed" in text and "p50 1.50 s" in text
    assert "10 samples, 900 tokens, 50.0% supervised" in text


def test_a_malformed_record_is_reported_not_raised(tmp_path: Path) -> None:
    _write(tmp_path / "model_facts.json", {"architecture": ["not", "a", "dict"]})
    (tmp_path / "tokenized").mkdir()
    (tmp_path / "tokenized" / "stats.json").write_text("{truncated")
    rows = summary.collect(tmp_path)
    assert rows == [("introspect", rows[0][1])]
    assert rows[0][1].startswith("record unreadable")


def test_servers_say_whether_they_were_last_seen_running_or_stopped(tmp_path: Path) -> None:
    launch = {"endpoint": "http://127.0.0.1:30000", "backend": "sglang", "mode": "systemd"}
    _write(tmp_path / "serving" / "ct200-main" / "launch.json", launch)
    _write(tmp_path / "serving" / "ct200-main" / "state.json", {"state": "stopped"})
    _write(tmp_path / "serving" / "ct201-main" / "launch.json", launch)
    _write(tmp_path / "serving" / "ct201-main" / "state.json", {"state": "running"})
    _write(tmp_path / "serving" / "old-main" / "launch.json", launch)  # recorded before state.json existed
    rows = [text for stage, text in summary.collect(tmp_path) if stage == "serve"]
    assert rows == [
        "ct200-main: http://127.0.0.1:30000 (sglang, systemd mode), stopped",
        "ct201-main: http://127.0.0.1:30000 (sglang, systemd mode), running",
        "old-main: http://127.0.0.1:30000 (sglang, systemd mode)",
    ]


def test_the_latest_recorded_run_is_a_row(tmp_path: Path) -> None:
    from regen import provenance

    _write(tmp_path / "tokenized" / "stats.json", {"samples": 10, "tokens": 900, "supervised_fraction": 0.5})
    assert "run" not in dict(summary.collect(tmp_path))
    recorded = provenance.record(tmp_path)
    assert dict(summary.collect(tmp_path))["run"].startswith(recorded["run_id"] + " (regen compare")


def test_training_shows_a_smoothed_loss_the_exported_drafter_and_a_loss_curve(tmp_path: Path) -> None:
    """Item 6 of issue 26: one step's loss swings; the summary adds the moving average the launcher folds
    from SpecForge's step lines, the exported drafter the recorded SGLang flags name, and a picture."""
    from regen.training import status as training_status

    record = new_status(total_steps=60)
    for step in range(1, 61):  # a loss that falls, swinging between two values around the trend
        loss = 3.0 - step / 30 + (0.8 if step % 2 else -0.8)
        training_status.apply_line(record, f"step {step}: {{'loss': {loss}}}")
    record.update(state="succeeded")
    _write(tmp_path / "drafter" / "gpu1" / "status.json", record)
    export = "/srv/regen/drafter/runs/dflash-1/export"
    (tmp_path / "drafter" / "gpu1" / "sglang_dflash.args").write_text(
        f"--speculative-algorithm\nDFLASH\n--speculative-draft-model-path\n{export}\n"
    )
    rows = [text for stage, text in summary.collect(tmp_path) if stage == "train"]
    head = rows[0]
    last = record["loss"]
    smoothed = float(head.split("moving average over ~20 steps ")[1].rstrip(")"))
    assert abs(smoothed - (3.0 - 60 / 30)) < 0.4 < abs(last - (3.0 - 60 / 30)), (head, last)
    assert f"gpu1: exported drafter {export}" in rows
    picture = tmp_path / "drafter" / "gpu1" / "loss_curve.png"
    assert f"gpu1: loss curve {picture}" in rows
    assert picture.read_bytes()[:4] == b"\x89PNG"
    before = picture.stat().st_mtime_ns
    summary.collect(tmp_path)  # an unchanged record does not rewrite the picture
    assert picture.stat().st_mtime_ns == before
