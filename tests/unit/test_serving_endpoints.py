"""The endpoints a stage run alone reads back from the serve stage's records (module_utils/regen_endpoints.py,
library/serving_endpoints_info.py): running ones only, a router before the servers behind it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible.module_utils.regen_endpoints import recorded_endpoints

from tests.helpers.modules import run_module

SERVER = {
    "state": "running", "kind": "server", "endpoint": "http://127.0.0.1:31000", "served_model_name": "m",
}


def test_running_servers_give_their_endpoints_and_model_name() -> None:
    other = dict(SERVER, endpoint="http://10.0.0.2:31000")
    found = recorded_endpoints({"a-main": SERVER, "b-main": other})
    assert found == {
        "endpoints": ["http://127.0.0.1:31000", "http://10.0.0.2:31000"],
        "served_model_name": "m",
        "kind": "server",
        "records": ["a-main", "b-main"],
    }


def test_a_running_router_wins_and_takes_the_servers_model_name() -> None:
    router = {"state": "running", "kind": "router", "endpoint": "http://127.0.0.1:30080"}
    found = recorded_endpoints({"a-main": SERVER, "a-router": router})
    assert found["endpoints"] == ["http://127.0.0.1:30080"] and found["kind"] == "router"
    assert found["served_model_name"] == "m"


def test_stopped_servers_and_records_without_an_endpoint_give_none() -> None:
    capture = {"state": "running", "kind": "server"}  # the capture server records no endpoint
    found = recorded_endpoints({"a-main": {"state": "stopped"}, "a-capture": capture})
    assert found == {"endpoints": [], "served_model_name": None, "kind": None, "records": []}


def test_the_module_reads_the_records_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_module("serving_endpoints_info", {"path": str(tmp_path / "none")}, capsys)["endpoints"] == []
    record = tmp_path / "serving" / "localhost-main"
    record.mkdir(parents=True)
    (record / "state.json").write_text(json.dumps(SERVER))
    (tmp_path / "serving" / "localhost-router").mkdir()  # a directory without a state.json is skipped
    result = run_module("serving_endpoints_info", {"path": str(tmp_path / "serving")}, capsys)
    assert result["endpoints"] == ["http://127.0.0.1:31000"] and result["records"] == ["localhost-main"]
    (record / "state.json").write_text("{not json")
    result = run_module("serving_endpoints_info", {"path": str(tmp_path / "serving")}, capsys)
    assert result["failed"] and "re-run the serve stage" in result["msg"]
