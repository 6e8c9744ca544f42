"""The attention-backend table: one test per row, the fall-backs, and SGLang 0.5.23's own parser.

The parser test runs `--attention-backend NAME` for every name the table can put on a launch line
through SGLang's real argument parser in the throwaway venv (tests/fixtures/serving/sglang_venv.py, the
same one tests/unit/test_serving_argv.py uses), and a made-up name must be rejected there, so the check
can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "serving"

from ansible.module_utils import regen_attention_backends as ab

# (row id, compute capability as facts write it, attention kind, attention sinks, expected backend)
ROW_CASES = [
    ("sm120-mla", "12.0", "mla", False, "flashinfer"),
    ("sm100-mla", "10.0", "mla", False, "trtllm_mla"),
    ("sm90-mla", "9.0", "mla", False, "fa3"),
    ("other-mla", "8.9", "mla", False, "triton"),
    ("sinks", "12.0", "gqa", True, "triton"),
    ("sm100-mha", "10.3", "gqa", False, "trtllm_mha"),
    ("sm90-mha", "9.0", "mha", False, "fa3"),
    ("sm120-mha", "12.0", "gqa", False, "flashinfer"),
    ("other-mha", "8.0", "mha", False, "flashinfer"),
]


def test_every_row_has_a_case_and_a_public_source():
    assert sorted(r["id"] for r in ab.BACKEND_TABLE) == sorted(c[0] for c in ROW_CASES)
    for row in ab.BACKEND_TABLE:
        assert row["sources"], row["id"]
        assert row["reason"], row["id"]
        assert any(s.startswith("https://") or s.startswith("SGLang 0.5.23") for s in row["sources"])


@pytest.mark.parametrize(("row", "cc", "kind", "sinks", "value"), ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_row(row, cc, kind, sinks, value):
    got = ab.choose_backend(cc, kind, "0.5.23", attention_sinks=sinks)
    assert got["row"] == row
    assert got["value"] == value
    assert got["reason"] and got["source"]
    assert got["compute_capability"] == cc


def test_sm120_mla_avoids_trtllm_mla_and_names_the_reports():
    got = ab.choose_backend("12.0", "mla")
    assert got["value"] == "flashinfer"
    # SGLang 0.5.23 left alone would pick triton on sm_120; the table says so.
    assert got["sglang_default"] == "triton"
    assert "trtllm_mla" in got["avoid"]
    assert ab.SGLANG_ISSUE_24633 in got["avoid"]["trtllm_mla"]
    assert ab.FLASHINFER_ISSUE_3263 in got["source"]
    assert "Unsupported architecture" in got["reason"]


def test_sinks_keep_sglangs_own_choice_on_hopper_and_sm100():
    assert ab.choose_backend("9.0", "gqa", attention_sinks=True)["value"] == "fa3"
    assert ab.choose_backend("10.0", "gqa", attention_sinks=True)["value"] == "trtllm_mha"


def test_override_wins_and_warns_when_the_table_advises_against_it():
    got = ab.choose_backend("12.0", "mla", override="trtllm_mla")
    assert got["value"] == "trtllm_mla"
    assert "warning" in got["reason"] and "Unsupported architecture" in got["reason"]
    quiet = ab.choose_backend("12.0", "mla", override="triton")
    assert quiet["value"] == "triton" and "warning" not in quiet["reason"]


@pytest.mark.parametrize(
    ("cc", "kind", "version", "why"),
    [
        (None, "mla", "0.5.23", "compute capability unknown"),
        ("12.0", None, "0.5.23", "attention kind unknown"),
        ("12.0", "linear", "0.5.23", "no table row"),
        ("12.0", "mla", "0.4.0", "no backend table for SGLang 0.4.0"),
    ],
)
def test_no_row_leaves_the_flag_off_and_says_why(cc, kind, version, why):
    got = ab.choose_backend(cc, kind, version)
    assert got["value"] is None
    assert why in got["reason"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12.0", (12, 0)),
        ("12", (12, 0)),
        ("sm_120", (12, 0)),
        ("sm90", (9, 0)),
        ("10.3", (10, 3)),
        (9.0, (9, 0)),
        ((12, 1), (12, 1)),
        ("", None),
        ("gpu", None),
    ],
)
def test_parse_compute_capability(text, expected):
    assert ab.parse_compute_capability(text) == expected


@pytest.mark.parametrize(
    ("model", "cc", "value", "row"),
    [
        ("kimi-k2.5", "12.0", "flashinfer", "sm120-mla"),
        ("kimi-k2.5", "10.0", "trtllm_mla", "sm100-mla"),
        ("deepseek-v3", "9.0", "fa3", "sm90-mla"),
        ("gpt-oss-120b", "12.0", "triton", "sinks"),
        ("qwen3-8b", "12.0", "flashinfer", "sm120-mha"),
    ],
)
def test_backend_for_real_configs(model, cc, value, row):
    from ansible.module_utils import regen_config

    config = json.loads((ROOT / "tests" / "fixtures" / "configs" / model / "config.json").read_text())
    arch = regen_config.normalize_config(config)
    got = ab.backend_for_facts({"architecture": arch, "environment": {"gpu": {"compute_capabilities": [cc]}}})
    assert (got["value"], got["row"]) == (value, row)


@pytest.fixture(scope="module")
def sglang_python():
    sys.path.insert(0, str(FIXTURES))
    from sglang_venv import VenvError, sglang_venv_python

    try:
        return sglang_venv_python()
    except VenvError as exc:
        pytest.fail(str(exc))


def test_every_table_name_is_a_choice_of_sglangs_parser(sglang_python):
    names = ab.table_values()
    items = [
        {"kind": "server", "argv": ["--model-path", "/models/x", "--attention-backend", n]} for n in names
    ]
    items.append(
        {"kind": "server", "argv": ["--model-path", "/models/x", "--attention-backend", "made_up_mla"]}
    )
    proc = subprocess.run(
        [str(sglang_python), str(FIXTURES / "sglang_parse_argv.py")],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    for name, result in zip(names, results[:-1], strict=True):
        assert result["ok"], f"SGLang 0.5.23 rejects --attention-backend {name}: {result['error']}"
        assert result["values"]["attention_backend"] == name
    assert not results[-1]["ok"], "a made-up backend must be rejected, or this check cannot fail"
