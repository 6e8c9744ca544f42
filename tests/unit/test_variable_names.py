"""Item 1 of issue 26: a variable the inventory or -e sets that no role declares fails at the start of the
run with the closest known names. The pure logic here; tests/integration/test_variable_names_check.py runs
it as a user does (ansible-playbook with a misspelled name)."""

from __future__ import annotations

from pathlib import Path

from ansible.module_utils.regen_variables import describe_unknown, role_variables, unknown_variables

ROOT = Path(__file__).resolve().parents[2]


def test_the_roles_declare_their_spec_options_and_defaults() -> None:
    declared = role_variables(str(ROOT / "roles"))
    # A spec option, a defaults key, and a global of the regen role.
    assert declared["prompt_data_sources"] == "prompt_data"
    assert declared["regen_work_dir"] == "regen"
    assert "regen_user_variables" in declared
    # every role with a spec contributes
    with_specs = {p.parts[-3] for p in (ROOT / "roles").glob("*/meta/argument_specs.yml")}
    assert with_specs <= set(declared.values())


def test_a_misspelled_name_is_reported_with_the_closest_names() -> None:
    declared = role_variables(str(ROOT / "roles"))
    given = ["prompt_data_souces", "regen_profile", "ansible_host", "inventory_hostname", "groups"]
    unknown = unknown_variables(given, declared)
    assert [u["name"] for u in unknown] == ["prompt_data_souces"]
    assert unknown[0]["suggestions"][0] == "prompt_data_sources"
    message = describe_unknown(unknown, "ct200")
    assert "prompt_data_souces: did you mean prompt_data_sources" in message
    assert "regen_user_variables" in message


def test_a_name_the_user_declares_passes_and_a_far_name_has_no_suggestion() -> None:
    declared = role_variables(str(ROOT / "roles"))
    assert unknown_variables(["my_team_label"], declared, ["my_team_label"]) == []
    unknown = unknown_variables(["zzqx"], declared)
    assert unknown == [{"name": "zzqx", "suggestions": []}]
    assert "zzqx: no close name" in describe_unknown(unknown, "h")


def test_a_missing_roles_dir_declares_nothing(tmp_path: Path) -> None:
    assert role_variables(str(tmp_path / "absent")) == {}


def test_a_directory_is_claimed_once_and_a_gone_owner_claims_nothing(tmp_path: Path) -> None:
    from ansible.module_utils.regen_ownership import claim

    mine, other = tmp_path / "inv-mine", tmp_path / "inv-other"
    mine.mkdir()
    other.mkdir()
    data = tmp_path / "data"
    assert claim(str(data), str(mine)) == ("claimed", str(mine))
    assert claim(str(data), str(mine)) == ("owned", str(mine))
    assert claim(str(data), str(other)) == ("foreign", str(mine))
    mine.rmdir()  # the checkout moved: its old inventory path is gone
    assert claim(str(data), str(other), write=False) == ("claimed", str(other))
    assert claim(str(data), str(other)) == ("claimed", str(other))
    assert claim(str(data), str(other)) == ("owned", str(other))


def test_cached_facts_are_not_user_variables() -> None:
    """A warm fact cache (ansible.cfg: jsonfile) brings the setup module's `gather_subset` and
    `module_setup` back as host variables: they are the host's facts, not misspelled names."""
    declared = role_variables(str(ROOT / "roles"))
    given = ["gather_subset", "module_setup", "regen_profile"]
    assert [u["name"] for u in unknown_variables(given, declared)] == ["gather_subset", "module_setup"]
    assert unknown_variables(given, declared, facts=["gather_subset", "module_setup", "distribution"]) == []
