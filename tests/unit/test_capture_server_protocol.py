"""regen.training.capture_server's protocol, as SpecForge 0.2.0's SGLangServerCaptureAdapter speaks it.

The requests below have the shape `SGLangServerCaptureAdapter.produce_refs` posts (its `_request_inputs`
and `_spec_capture_payload`); the integration test drives the real adapter against the real server.
"""

from __future__ import annotations

import pytest

from regen.training import capture_server as cs


def _payload(sample_id: str, length: int) -> dict:
    return {
        "store_id": "run-1",
        "sample_id": sample_id,
        "gen": 1,
        "replace": False,
        "features": {"aux": "hidden_states"},
        "passthrough": [
            {"name": "input_ids", "data": list(range(length)), "shape": [1, length], "dtype": "int64"},
            {"name": "loss_mask", "data": [1] * length, "shape": [1, length], "dtype": "int64"},
        ],
    }


def _body(*lengths: int) -> dict:
    return {
        "input_ids": [list(range(n)) for n in lengths],
        "extra_key": ["k"] * len(lengths),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 0},
        "spec_capture": [_payload(f"run-1:t{i}", n) for i, n in enumerate(lengths)],
    }


def test_a_specforge_batch_parses_into_prompts() -> None:
    prompts = cs.parse_request(_body(3, 5), max_length=8)
    assert [len(p["input_ids"]) for p in prompts] == [3, 5]
    assert prompts[1]["spec"]["sample_id"] == "run-1:t1"
    # One prompt (not a batch) is a list of ids with one payload, as SGLang takes it too.
    single = dict(_body(4), input_ids=list(range(4)), spec_capture=_payload("run-1:t0", 4))
    assert len(cs.parse_request(single, None)) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"spec_capture": None}, "one capture payload per prompt"),
        ({"sampling_params": {"max_new_tokens": 16}}, "max_new_tokens must be 0"),
        ({"input_ids": []}, "non-empty list"),
    ],
)
def test_requests_it_cannot_serve_are_refused_with_the_reason(change: dict, message: str) -> None:
    with pytest.raises(cs.CaptureRequestError, match=message):
        cs.parse_request({**_body(3), **change}, None)


def test_a_prompt_longer_than_the_context_is_refused() -> None:
    with pytest.raises(cs.CaptureRequestError, match="more than this server's --max-length 4"):
        cs.parse_request(_body(5), max_length=4)


def test_a_passthrough_that_does_not_match_its_shape_is_refused() -> None:
    body = _body(3)
    body["spec_capture"][0]["passthrough"][0]["shape"] = [1, 4]
    with pytest.raises(cs.CaptureRequestError, match="3 values for shape"):
        cs.parse_request(body, None)
    body = _body(3)
    body["spec_capture"][0]["passthrough"][0]["dtype"] = "complex64"
    with pytest.raises(cs.CaptureRequestError, match="unsupported dtype"):
        cs.parse_request(body, None)


def test_keys_and_rows_follow_the_patch() -> None:
    # SpecCaptureSink._tkey and MooncakeFeatureStore._tkey: {store_id}/{sample_id}/g{gen}/{name}.
    assert cs.object_key("run-1", "run-1:t0", 1, "hidden_states") == "run-1/run-1:t0/g1/hidden_states"
    row = cs.response_row({"sample_id": "s"}, 7, {"sample_id": "s", "error": "x"})
    assert row["meta_info"]["spec_capture"] == {"sample_id": "s", "error": "x"}
    assert row["meta_info"]["prompt_tokens"] == 7 and row["output_ids"] == []


def test_mooncake_settings_come_from_the_patchs_variables() -> None:
    with pytest.raises(cs.CaptureRequestError, match="MOONCAKE_MASTER_SERVER_ADDR and MOONCAKE_METADATA"):
        cs.mooncake_settings({})
    settings = cs.mooncake_settings(
        {
            "MOONCAKE_MASTER_SERVER_ADDR": "127.0.0.1:50051",
            "MOONCAKE_METADATA_SERVER": "http://127.0.0.1:8080/metadata",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1024",
        }
    )
    assert settings["global_segment_size"] == 1024 and settings["protocol"] == "tcp"
    assert settings["master_server_addr"] == "127.0.0.1:50051"
