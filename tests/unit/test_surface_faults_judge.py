"""The surface fault campaign's verdicts can fail: each finds what it is for (surface_faults)."""

from __future__ import annotations

import random
from pathlib import Path

from tests.helpers.surface_faults import Case, damage_bytes, judge


def test_each_verdict_finds_its_problem(tmp_path: Path) -> None:
    case = Case(["x"], (2,), "data_00000005.ckpt")
    assert judge(case, 2, "", "round 1: first: data_00000005.ckpt")[0] == "ok"
    assert judge(case, 4, "", "Traceback (most recent call last):\n  ...\nOSError: boom")[0] == "traceback"
    assert judge(case, 0, "{}", "")[0] == "silent_pass"
    assert judge(case, 1, "", "data_00000005.ckpt")[0] == "wrong_exit"
    assert judge(case, 2, "", "something else")[0] == "unnamed"
    repair = Case(["x"], (0,), "made again", forbid='"changed": false')
    assert judge(repair, 0, '{"changed": false}', "")[0] == "silent_pass"
    (tmp_path / "status.json").write_text('{"endpoint": "http://u:pw-1@h"}')
    leaky = Case(["x"], (3,), "nothing answers", secret="pw-1", scan=(tmp_path,))
    assert judge(leaky, 3, "", "nothing answers")[0] == "leak"


def test_damage_always_changes_the_bytes() -> None:
    rng = random.Random(0)
    data = b'{"name": "tp1", "levels": []}'
    assert all(damage_bytes(data, rng) != data for _ in range(500))
