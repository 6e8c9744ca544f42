"""Host-side helpers of the drafter_training role (src/regen/training): status parsing, the launcher's
supervision, checkpoint listing and resume choice, and the offline hidden-state capture.

The launcher tests run `stub_trainer`, a STUB standing in for SpecForge: it prints SpecForge 0.2.0's real
step-line format (copied from a real CPU run, see tests/fixtures/drafter/specforge_cpu_train.log) and
then exits, fails, hangs or dies on cue. It exists to inject faults the real trainer cannot be made to
produce on demand; the real SpecForge run is the role's end-to-end test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regen.status import validate
from regen.training import capture, checkpoints, launcher, status

ROOT = Path(__file__).resolve().parents[2]
REAL_LOG = ROOT / "tests" / "fixtures" / "drafter" / "specforge_cpu_train.log"

STUB_TRAINER = r"""
import sys, time
mode, steps = sys.argv[1], int(sys.argv[2])
print("Loading ['model.embed_tokens.weight', 'lm_head.weight'] from model.safetensors...", flush=True)
for step in range(1, steps + 1):
    print("step %d: {'acc': %.2f, 'loss': %.3f, 'grad_norm': 1.0, 'lr': 0.001, "
          "'perf/optimizer_step_time_s': 0.05}" % (step, step / 10, 5.0 - step / 10), flush=True)
    time.sleep(0.05)
if mode == "fail":
    print("Traceback (most recent call last):", flush=True)
    print("ValueError: checkpoint was written with effective_total_steps=3", flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(600)
"""


@pytest.fixture()
def stub(tmp_path: Path) -> Path:
    path = tmp_path / "stub_trainer.py"
    path.write_text(STUB_TRAINER)
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _launcher(*args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "regen.training.launcher", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout)


# ---- status -------------------------------------------------------------------------------------------


def test_real_specforge_log_lines_parse() -> None:
    lines = REAL_LOG.read_text().splitlines()
    record = status.fold(lines, status.new_status(total_steps=4))
    assert record["done"] == 4 and record["state"] == "running"
    assert record["loss"] == pytest.approx(8.306097984313965) and record["acc"] == 0.0
    assert record["lr"] == 0.0 and record["step_time_s"] == pytest.approx(0.01821608499994909)
    assert status.parse_step_line("Loading weights: 100%") is None
    assert status.parse_step_line("step 3: {not a dict}") is None
    assert status.parse_step_line("[rank0]: step 7: {'loss': 1.5}") == (7, {"loss": 1.5})


def test_eta_uses_the_measured_pace() -> None:
    record = status.new_status(total_steps=100)
    status.apply_line(record, "step 10: {'loss': 2.0, 'perf/optimizer_step_time_s': 0.5}", now=1000.0)
    assert record["eta_s"] == 45.0  # first step seen: SpecForge's own step time, 90 x 0.5 s
    status.apply_line(record, "step 20: {'loss': 1.9}", now=1020.0)
    assert record["eta_s"] == 160.0  # 10 steps took 20 s: 80 left x 2 s
    line = status.progress_line(record)
    assert line == "running | step 20/100 | loss 1.9000 | eta 2m40s"


def test_error_lines_are_kept_and_status_files_are_atomic(tmp_path: Path) -> None:
    record = status.new_status()
    assert status.apply_line(record, "[rank0]: RuntimeError: CUDA out of memory")
    assert record["error"] == "RuntimeError: CUDA out of memory"
    path = tmp_path / "s" / "status.json"
    status.write_status(path, record)
    assert status.read_status(path)["line"].startswith("starting | step 0/?")
    assert [p.name for p in path.parent.iterdir()] == ["status.json"]
    path.write_text("{torn")
    assert status.read_status(path) is None


# ---- launcher -----------------------------------------------------------------------------------------


def test_run_supervises_a_successful_trainer(tmp_path: Path, stub: Path) -> None:
    code = launcher.run(
        [sys.executable, str(stub), "ok", "3"],
        str(tmp_path / "status.json"),
        str(tmp_path / "train.log"),
        3,
        None,
    )
    assert code == 0
    record = status.read_status(tmp_path / "status.json")
    assert validate(record) == [], "the status file follows the jobs' one schema"
    assert record["state"] == "succeeded" and record["done"] == 3 and record["exit_code"] == 0
    assert record["loss"] == pytest.approx(4.7) and record["acc"] == pytest.approx(0.3)
    log = (tmp_path / "train.log").read_text()
    assert "step 3: {" in log and "regen launcher: succeeded" in log


def test_a_failing_trainer_is_failed_with_its_error(tmp_path: Path, stub: Path) -> None:
    code = launcher.run(
        [sys.executable, str(stub), "fail", "2"],
        str(tmp_path / "status.json"),
        str(tmp_path / "train.log"),
        3,
        None,
    )
    record = status.read_status(tmp_path / "status.json")
    assert code == 3 and record["state"] == "failed" and record["exit_code"] == 3
    assert record["error"].startswith("ValueError: checkpoint was written")
    assert "error: ValueError" in record["line"]


def test_a_missing_trainer_is_a_clear_failure(tmp_path: Path) -> None:
    code = launcher.run(
        ["/nonexistent/specforge", "train"],
        str(tmp_path / "status.json"),
        str(tmp_path / "train.log"),
        None,
        None,
    )
    assert code == 127
    assert "cannot start /nonexistent/specforge" in status.read_status(tmp_path / "status.json")["error"]


def _start(tmp_path: Path, stub: Path, mode: str, steps: str) -> dict:
    return _launcher(
        "start",
        "--name",
        "regen-test",
        "--mode",
        "process",
        "--status",
        str(tmp_path / "status.json"),
        "--log",
        str(tmp_path / "train.log"),
        "--total-steps",
        steps,
        "--meta",
        '{"run_id": "r1"}',
        "--",
        sys.executable,
        str(stub),
        mode,
        steps,
    )


def test_start_detaches_and_status_waits_for_the_end(tmp_path: Path, stub: Path) -> None:
    # 60 steps of 0.05 s: the run outlasts the second `start` (a 5-step run could end before it looked,
    # and a start after the end rightly launches a new run).
    started = _start(tmp_path, stub, "ok", "60")
    assert started["started"] and started["mode"] == "process"
    again = _start(tmp_path, stub, "ok", "60")  # a second start while it runs launches nothing
    assert again["started"] is False and again["reason"] == "already running"
    final = _launcher("status", "--status", str(tmp_path / "status.json"), "--wait", "30", "--until-final")
    assert final["state"] == "succeeded" and final["done"] == 60 and final["run_id"] == "r1"
    assert final["mode"] == "process"


def test_stop_lets_the_trainer_go_and_records_it(tmp_path: Path, stub: Path) -> None:
    _start(tmp_path, stub, "hang", "2")
    deadline = time.monotonic() + 20
    while (status.read_status(tmp_path / "status.json") or {}).get(
        "done"
    ) != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    stopped = _launcher("stop", "--status", str(tmp_path / "status.json"), "--timeout", "10")
    assert stopped["stopped"] is True
    final = _launcher("status", "--status", str(tmp_path / "status.json"), "--wait", "10", "--until-final")
    assert final["state"] == "stopped"


def test_a_vanished_supervisor_is_reported_lost(tmp_path: Path, stub: Path) -> None:
    _start(tmp_path, stub, "hang", "1")
    deadline = time.monotonic() + 20
    while (status.read_status(tmp_path / "status.json") or {}).get(
        "state"
    ) != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    record = status.read_status(tmp_path / "status.json")
    os.killpg(os.getpgid(record["pid"]), signal.SIGKILL)  # a host crash, as far as the status knows
    time.sleep(0.3)
    record["launched_at"] = 0  # past the grace period for a just-started supervisor
    status.write_status(tmp_path / "status.json", record)
    assert _launcher("status", "--status", str(tmp_path / "status.json"))["state"] == "lost"


def test_status_of_nothing_is_absent(tmp_path: Path) -> None:
    assert _launcher("status", "--status", str(tmp_path / "none.json"))["state"] == "absent"


# ---- checkpoints --------------------------------------------------------------------------------------


def _checkpoint(root: Path, run: str, step: int, complete: bool = True) -> Path:
    path = root / f"{run}-step{step}"
    path.mkdir(parents=True)
    (path / "training_state_rank0.pt").write_bytes(b"r" * 10)
    if complete:
        (path / "training_state.pt").write_bytes(b"s" * 100)
    return path


def test_checkpoints_pick_the_latest_complete_one(tmp_path: Path) -> None:
    assert checkpoints.describe(tmp_path / "none", "run")["resume_from"] is None
    _checkpoint(tmp_path, "run", 2)
    four = _checkpoint(tmp_path, "run", 4)
    _checkpoint(tmp_path, "run", 6, complete=False)  # a save a crash interrupted
    _checkpoint(tmp_path, "other", 9)
    info = checkpoints.describe(tmp_path, "run")
    assert [c["step"] for c in info["checkpoints"]] == [2, 4, 6]
    assert info["resume_from"] == str(four) and info["incomplete"] == [str(tmp_path / "run-step6")]
    assert info["checkpoints"][0]["bytes"] == 110
    (tmp_path / "run-latest").symlink_to("run-step2")  # SpecForge's pointer wins when it is valid
    assert checkpoints.latest_checkpoint(tmp_path, "run")["step"] == 2


# ---- capture ------------------------------------------------------------------------------------------


ROWS = [
    ([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1]),
    ([11, 12, 13], [0, 1, 0]),
    ([14, 15, 16, 17], [0, 0, 1, 1]),
    ([20, 21, 22, 23, 24, 25, 26, 27], [1] * 8),
]


def _tokenized(directory: Path) -> None:
    """The tokenize stage's layout: data/<shard>.parquet plus conversations and rejects JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (directory / "data").mkdir(parents=True)
    table = pa.table(
        {"input_ids": [r[0] for r in ROWS], "loss_mask": [r[1] for r in ROWS], "id": list("abcd")}
    )
    pq.write_table(table, directory / "data" / "part-00000.parquet")
    (directory / "conversations.jsonl").write_text(json.dumps({"id": "a", "conversations": []}) + "\n")
    (directory / "rejects.jsonl").write_text(
        json.dumps({"id": "z", "reason": "empty", "input_ids": [1, 2]}) + "\n"
    )


def test_count_follows_specforges_filter(tmp_path: Path) -> None:
    _tokenized(tmp_path / "tok")
    # Sample "b" has no two neighbouring supervised tokens: SpecForge's DFlash reader would reject it.
    full = capture.count(tmp_path / "tok", 2048, None)
    keys = ("samples", "tokens", "dropped")
    assert {k: full[k] for k in keys} == {"samples": 3, "tokens": 18, "dropped": 1}
    short = capture.count(tmp_path / "tok", 5, None)
    assert {k: short[k] for k in keys} == {"samples": 3, "tokens": 14, "dropped": 1}
    assert short["fingerprint"] != full["fingerprint"]  # truncation changes what is trained on
    assert capture.count(tmp_path / "tok", 2048, 1)["samples"] == 1
    with pytest.raises(capture.CaptureError, match="run the tokenize stage"):
        capture.count(tmp_path / "missing", 2048, None)
    # Without Parquet, JSONL records carrying input_ids and loss_mask are read (other JSONL is skipped).
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    (jsonl / "a.jsonl").write_text(
        "".join(json.dumps({"input_ids": i, "loss_mask": m}) + "\n" for i, m in ROWS)
    )
    (jsonl / "b.jsonl").write_text(json.dumps({"conversations": []}) + "\n")
    # The same samples in another container: the same identity.
    assert capture.count(jsonl, 2048, None) == full
    (jsonl / "a.jsonl").write_text("not json\n")
    with pytest.raises(capture.CaptureError, match=r"a\.jsonl:1 is not JSON"):
        capture.count(jsonl, 2048, None)


@pytest.mark.parametrize("state", ["failed", "interrupted", "running", "starting"])
def test_a_tokenize_output_whose_job_did_not_finish_is_refused(tmp_path: Path, state: str) -> None:
    _tokenized(tmp_path / "tok")
    status = {
        "job": "tokenize",
        "state": state,
        "error": "No space left on device" if state == "failed" else None,
    }
    (tmp_path / "tok" / "status.json").write_text(json.dumps(status))
    with pytest.raises(capture.CaptureError, match=rf"did not finish \(status.json: state '{state}'"):
        capture.count(tmp_path / "tok", 2048, None)
    with pytest.raises(capture.CaptureError, match="did not finish"):
        capture.count(tmp_path / "tok" / "data", 2048, None)  # pointed at data/ itself
    (tmp_path / "tok" / "status.json").write_text(json.dumps({**status, "state": "done", "error": None}))
    assert capture.count(tmp_path / "tok", 2048, None)["samples"] == 3


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    path = tmp_path_factory.mktemp("target")
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def test_capture_writes_specforge_features_once(
    tmp_path: Path, tiny_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    _tokenized(tmp_path / "tok")
    out = tmp_path / "hs"
    argv = [
        "--data",
        str(tmp_path / "tok"),
        "--model",
        str(tiny_target),
        "--layers",
        "1,3",
        "--output",
        str(out),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    assert capture.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 3
    files = sorted(p.name for p in out.glob("*.ckpt"))
    assert files == ["data_00000000.ckpt", "data_00000002.ckpt", "data_00000003.ckpt"]
    sample = torch.load(out / "data_00000003.ckpt", weights_only=True)
    assert sample["input_ids"].tolist() == [20, 21, 22, 23, 24, 25, 26, 27] and sample["loss_mask"].sum() == 8
    # The features are the outputs of target layers 1 and 3, concatenated: what SpecForge's DFlash reads.
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(input_ids=sample["input_ids"][None], output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[2][0], hidden[4][0]], dim=-1)
    assert sample["hidden_states"].shape == (8, 64)
    torch.testing.assert_close(sample["hidden_states"], expected)
    # A re-run captures nothing; a lost file is recaptured alone.
    (out / "data_00000002.ckpt").unlink()
    assert capture.main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {
        "bytes": (out / "data_00000002.ckpt").stat().st_size,
        "dropped": 1,
        "forwards": 1,
        "samples": 3,
        "skipped": 2,
        "tokens": 18,
        "written": 1,
        "fingerprint": capture.count(tmp_path / "tok", 2048, None)["fingerprint"],
    }
    # A file cut short (issue 25: 100 bytes passed as "captured") is not the size the capture recorded
    # beside the directory: it is captured again, and the record's sha256 matches the new file.
    with open(out / "data_00000003.ckpt", "r+b") as handle:
        handle.truncate(100)
    assert capture.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["written"], summary["skipped"]) == (1, 2)
    assert capture.damaged(out, [0, 2, 3]) == []
    assert capture.read_digests(out)[3]["sha256"] == capture.file_sha256(out / "data_00000003.ckpt")
    # Other data (one token changed) never reuses these features, even with matching file names.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [list(r) for r in ROWS]
    rows[0] = ([99, *ROWS[0][0][1:]], ROWS[0][1])
    table = pa.table({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]})
    pq.write_table(table, tmp_path / "tok" / "data" / "part-00000.parquet")
    assert capture.main(argv) == 2
    assert "other settings" in json.loads(capsys.readouterr().out)["msg"]
    assert sorted(p.name for p in out.glob("*.ckpt")) == files
    # Features of other layers never mix with these.
    with pytest.raises(capture.CaptureError, match="other settings"):
        capture.check_manifest(out, {**json.loads((out / capture.MANIFEST).read_text()), "layers": [2]})


def test_capture_only_fills_the_placeholders_a_round_lists(
    tmp_path: Path, tiny_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _tokenized(tmp_path / "tok")  # samples 0, 2 and 3 are kept (1 is dropped)
    out = tmp_path / "hs"
    out.mkdir()
    for index in (0, 2, 3):  # a rolling run's placeholders: names SpecForge lists, nothing captured yet
        capture.sample_path(out, index).touch()
    (tmp_path / "round.json").write_text(json.dumps({"indices": [0, 3]}))
    argv = ["--data", str(tmp_path / "tok"), "--model", str(tiny_target), "--layers", "1,3"]
    argv += ["--output", str(out), "--device", "cpu", "--only", str(tmp_path / "round.json")]
    assert capture.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["written"], result["samples"], result["selected"], result["skipped"]) == (2, 2, 3, 0)
    assert [capture.sample_path(out, i).stat().st_size > 0 for i in (0, 2, 3)] == [True, False, True]
    # The manifest still names the whole data set, so any round's capture into this directory agrees.
    assert json.loads((out / capture.MANIFEST).read_text())["data"] == result["fingerprint"]
    assert result["fingerprint"] == capture.count(tmp_path / "tok", 2048, None)["fingerprint"]
    assert capture.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == 2
    # A round naming a sample the data does not have (the data changed under the ledger) is refused.
    (tmp_path / "round.json").write_text(json.dumps({"indices": [1, 3]}))
    assert capture.main(argv) == 2
    assert "lists 1 sample(s) the data does not have (first: 1)" in json.loads(capsys.readouterr().out)["msg"]
    (tmp_path / "round.json").write_text("[1, 3]")
    assert capture.main(argv) == 2
    assert "not a JSON object with an 'indices' list" in json.loads(capsys.readouterr().out)["msg"]


def test_batches_group_samples_by_length_within_the_token_budget() -> None:
    lengths = [5, 12, 3, 12, 7, 40]
    # Longest first; a batch's width is its first (longest) sample: 40 alone (over budget with another),
    # then 12+12 (24 <= 32, a third would make 36), then 7+5+3 (21), in input order among equals.
    assert capture.plan_batches(lengths, 32) == [[5], [1, 3], [4, 0, 2]]
    assert capture.plan_batches(lengths, 0) == [[5], [1], [3], [4], [0], [2]]
    for budget in (1, 16, 64, 1000):
        batches = capture.plan_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # each sample once
        assert all(len(b) == 1 or lengths[b[0]] * len(b) <= budget for b in batches)


def test_batched_capture_gives_each_sample_its_own_features(
    tmp_path: Path, tiny_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    _tokenized(tmp_path / "tok")
    base = ["--data", str(tmp_path / "tok"), "--model", str(tiny_target), "--layers", "1,3"]
    base += ["--device", "cpu", "--dtype", "float32"]
    assert capture.main([*base, "--output", str(tmp_path / "one")]) == 0
    one = json.loads(capsys.readouterr().out)
    assert capture.main([*base, "--output", str(tmp_path / "batched"), "--batch-tokens", "64"]) == 0
    batched = json.loads(capsys.readouterr().out)
    assert (one["forwards"], batched["forwards"]) == (3, 1) and one["written"] == batched["written"] == 3
    for path in sorted((tmp_path / "one").glob("*.ckpt")):
        alone = torch.load(path, weights_only=True)
        together = torch.load(tmp_path / "batched" / path.name, weights_only=True)
        assert together["input_ids"].tolist() == alone["input_ids"].tolist()
        assert together["loss_mask"].tolist() == alone["loss_mask"].tolist()
        # Right padding cannot reach earlier positions of a causal model: the same features.
        torch.testing.assert_close(together["hidden_states"], alone["hidden_states"], rtol=1e-5, atol=1e-5)
        assert together["hidden_states"].untyped_storage().nbytes() == together["hidden_states"].nbytes


def test_a_full_disk_mid_capture_exits_5_without_a_traceback(tmp_path: Path, tiny_target: Path) -> None:
    # Issue 25: ENOSPC during capture was a traceback. A real full disk: a 12 KiB tmpfs in a mount
    # namespace of the capture's own (unshare), so nothing outside this test sees the mount.
    import shutil

    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], check=False).returncode:
        pytest.skip("no mount namespace here (unshare -m); the CI machine has one")
    _tokenized(tmp_path / "tok")
    out = tmp_path / "full" / "hs"
    out.parent.mkdir()
    argv = [sys.executable, "-m", "regen.training.capture", "--data", str(tmp_path / "tok")]
    argv += ["--model", str(tiny_target), "--layers", "1,3", "--output", str(out)]
    argv += ["--device", "cpu", "--dtype", "float32"]
    script = f'mount -t tmpfs -o size=12k tmpfs {out.parent} && exec "$@"'
    run = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 5, run.stdout + run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    message = json.loads(run.stdout.splitlines()[-1])["msg"]
    assert "cannot write the features" in message and "No space left on device" in message
