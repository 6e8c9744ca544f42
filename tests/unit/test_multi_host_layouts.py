"""Layouts across hosts the train stage does not run are refused by the plan (library/drafter_plan_info.py),
and the refusal names the ones it runs (module_utils/regen_training_topology.py, docs/multi-host.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.module_utils.regen_training_topology import SUPPORTED_MULTI_HOST_LAYOUTS, layout_refusal

import tests.unit.test_online_specforge as online_specforge


def _plan(tmp_path: Path, capsys, monkeypatch, **args) -> dict:
    """The Kimi K2.6 CT200 plan of test_online_specforge with `args` replacing its module arguments."""
    real = online_specforge.run_module

    def with_args(name, given, capsys_):
        return real(name, {**given, **args}, capsys_)

    monkeypatch.setattr(online_specforge, "run_module", with_args)
    return online_specforge._plan(tmp_path, capsys)


def _names_every_supported_layout(message: str) -> None:
    assert "Supported layouts across hosts:" in message and "docs/multi-host.md" in message
    for n, layout in enumerate(SUPPORTED_MULTI_HOST_LAYOUTS, 1):
        assert f"({n}) {layout}" in message


@pytest.mark.parametrize(
    ("topology", "refused"),
    [
        ("rolling", "rolling offline trains on one host"),
        ("online", "online training runs SpecForge's producer and every trainer rank on one host"),
    ],
)
def test_a_layout_across_trainer_hosts_the_stage_does_not_run_is_refused_naming_the_ones_it_does(
    tmp_path: Path, capsys, monkeypatch, topology: str, refused: str
) -> None:
    plan = _plan(
        tmp_path, capsys, monkeypatch, hosts=["train1", "train2"], host="train1", training_topology=topology
    )
    assert plan.get("failed"), plan
    assert refused in plan["msg"] and "train1, train2" in plan["msg"]
    _names_every_supported_layout(plan["msg"])


@pytest.mark.parametrize("topology", ["rolling", "online"])
def test_the_same_layout_on_one_trainer_host_is_planned(
    tmp_path: Path, capsys, monkeypatch, topology
) -> None:
    plan = _plan(tmp_path, capsys, monkeypatch, training_topology=topology)
    assert not plan.get("failed"), plan.get("msg")
    assert plan["training_topology"]["mode"] == topology


def test_offline_across_trainer_hosts_is_planned_with_torchrun_over_them(
    tmp_path, capsys, monkeypatch
) -> None:
    plan = _plan(
        tmp_path,
        capsys,
        monkeypatch,
        hosts=["train1", "train2"],
        host="train2",
        training_topology="offline",
        tokens=4_000,
        samples=10,
    )
    assert not plan.get("failed"), plan.get("msg")
    assert plan["training_topology"]["mode"] == "offline"
    assert (plan["topology"]["nnodes"], plan["topology"]["node_rank"]) == (2, 1)


def test_the_refusal_text_is_one_list() -> None:
    message = str(layout_refusal("x across hosts"))
    assert message.startswith("x across hosts. Supported layouts across hosts: (1) ")
    _names_every_supported_layout(message)
