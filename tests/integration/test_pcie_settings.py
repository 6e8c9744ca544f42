"""playbooks/pcie.yml in check mode on this machine (it stands in for the node): the report says what the
node has and the exact kernel-argument change, and nothing is written (no unit, no modprobe file)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.ansible import ansible_env, localhost_inventory, run_playbook


def test_report_only_in_check_mode(tmp_path):
    cmdline = Path("/proc/cmdline").read_text().split()
    wanted = "regen.test_arg=1"  # an argument no kernel here was booted with
    inventory = localhost_inventory(
        tmp_path / "hosts.yml",
        groups=("regen_hypervisor",),
        variables={"pcie_settings_kernel_args": [wanted], "pcie_settings_disable_acs": True},
    )
    run = run_playbook(
        "playbooks/pcie.yml",
        "--check",
        inventory=inventory,
        env=ansible_env(ANSIBLE_CALLBACK_RESULT_FORMAT="json"),  # one line per message
    )
    assert run.returncode == 0, run.output[-3000:]
    assert wanted not in cmdline
    assert f"add {wanted} to /etc/kernel/cmdline, then proxmox-boot-tool refresh, then reboot" in run.output
    assert "not applied: pcie_settings_apply_kernel_args is false" in run.output
    assert "IOMMU: " in run.output
    for path in (
        "/etc/systemd/system/regen-nvidia-nodes.service",
        "/etc/systemd/system/regen-disable-acs.service",
        "/etc/modprobe.d/regen-nvidia-uvm.conf",
    ):
        assert not Path(path).exists(), path
