"""NCCL peer-to-peer: the decision from two measurements, and how the facts carry it to the serving plan."""

from __future__ import annotations

import pytest
from ansible.module_utils.regen_gpu import P2P_SCHEMA, p2p_fingerprint, p2p_measurement

from regen.serving.p2p_probe import bus_bandwidth_gbps, decide


def _ok(busbw: float) -> dict:
    return {"ok": True, "busbw_gbps": busbw, "algbw_gbps": busbw, "seconds": 1.0, "error": None}


def test_bus_bandwidth_is_nccl_tests_definition() -> None:
    # 64 MiB in 10 ms over 8 ranks: algbw = 67108864 / 0.01 / 1e9 = 6.7108864 GB/s; busbw = algbw * 2*7/8.
    busbw, algbw = bus_bandwidth_gbps(64 * 1024 * 1024, 0.01, 8)
    assert algbw == pytest.approx(6.7108864)
    assert busbw == pytest.approx(6.7108864 * 14 / 8)
    assert bus_bandwidth_gbps(1000, 1.0, 1)[0] == 0.0  # one rank moves nothing over the bus
    with pytest.raises(ValueError):
        bus_bandwidth_gbps(1000, 0.0, 8)


def test_p2p_stays_on_when_it_works_and_is_faster() -> None:
    decision = decide({"p2p_on": _ok(40.0), "p2p_off": _ok(20.0)})
    assert decision["p2p"] is True and decision["env"] == {}
    for number in ("40.0 GB/s", "20.0 GB/s", "2.00x"):
        assert number in decision["reason"]


def test_p2p_goes_off_when_it_hangs_sums_wrong_or_is_slower() -> None:
    hung = {"ok": False, "error": "hung: no result after 180 s"}
    assert decide({"p2p_on": hung, "p2p_off": _ok(20.0)}) == {
        "p2p": False,
        "env": {"NCCL_P2P_DISABLE": "1"},
        "reason": "NCCL peer-to-peer failed (hung: no result after 180 s); with it off the all-reduce ran at "
        "20.0 GB/s bus bandwidth, so the server runs with NCCL_P2P_DISABLE=1",
    }
    wrong = {"ok": False, "error": "12 of 16777216 elements summed wrong"}
    assert decide({"p2p_on": wrong, "p2p_off": _ok(20.0)})["env"] == {"NCCL_P2P_DISABLE": "1"}
    slower = decide({"p2p_on": _ok(18.0), "p2p_off": _ok(20.0)})
    assert slower["p2p"] is False and "below the 1.00x" in slower["reason"]
    assert decide({"p2p_on": _ok(21.0), "p2p_off": _ok(20.0)}, min_gain=1.1)["p2p"] is False


def test_both_modes_failing_says_the_gpus_cannot_all_reduce() -> None:
    failed = {"ok": False, "error": "exited 1"}
    decision = decide({"p2p_on": failed, "p2p_off": failed})
    assert decision["p2p"] is False and "cannot all-reduce" in decision["reason"]


def _gpu(uuids: list[str], driver: str = "580.95.05") -> dict:
    return {"gpus": [{"uuid": u} for u in uuids], "driver_version": driver}


def test_a_measurement_holds_for_the_same_gpus_and_driver_only() -> None:
    here = p2p_fingerprint(_gpu(["GPU-b", "GPU-a"]))
    assert here == p2p_fingerprint(_gpu(["GPU-a", "GPU-b"]))  # order of listing does not matter
    assert here != p2p_fingerprint(_gpu(["GPU-a", "GPU-c"]))  # a swapped card measures again
    assert here != p2p_fingerprint(_gpu(["GPU-a", "GPU-b"], driver="590.1"))
    doc = {
        "schema": P2P_SCHEMA,
        "fingerprint": here,
        "world_size": 2,
        "modes": {"p2p_on": _ok(40.0), "p2p_off": _ok(20.0)},
        "decision": decide({"p2p_on": _ok(40.0), "p2p_off": _ok(20.0)}),
    }
    entry = p2p_measurement(doc, here)
    assert entry["measured"] is True and entry["p2p"] is True and entry["env"] == {}
    assert entry["busbw_gbps"] == {"p2p_on": 40.0, "p2p_off": 20.0}
    stale = p2p_measurement(doc, p2p_fingerprint(_gpu(["GPU-z"])))
    assert stale["measured"] is False and "re-run the provision stage" in stale["reason"]
    assert p2p_measurement({"schema": "other"}, here)["measured"] is False
