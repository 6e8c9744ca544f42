"""`molecule test` of each scenario against a real LXC container (systemd Debian) standing in for CT200,
with converge, idempotence and testinfra verification:

- `default`: the provisioning playbook, then the Mooncake master under systemd on the stand-in's bridge
  address, and the firewall stage admitting a capture container to it and keeping a third one out
  (molecule/default/README.md);
- `serve`: provision, introspect, prompts, serve and generate on three containers, a model server running
  as a systemd unit on two of them behind sglang-router and the generation job on the third, through the
  router with the API key, then teardown, the serve stage's "leave a stopped server stopped" path, and a
  serving container restarted and one stopped mid-run (molecule/serve/README.md).

The scenario installs what it needs itself (lxc, debootstrap, the lxcbr0 bridge) through
scripts/lxc-test-host.sh; LXC system containers need root, so this test says so instead of skipping.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.e2e, pytest.mark.lxc]


# scenario -> its platforms (molecule/<scenario>/molecule.yml); a container is <platform>-<checkout hash>.
SCENARIOS = {
    "default": ("ct200-standin", "ct200-capture", "ct200-outsider"),
    "serve": ("ct200-serve", "ct200-serve2", "ct200-gen"),
}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_molecule_scenario_on_lxc(scenario: str) -> None:
    assert os.geteuid() == 0, "LXC system containers need root: run the e2e tests as root (CI does)"
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "ANSIBLE_FORCE_COLOR": "0",
        "NO_COLOR": "1",
        "PY_COLORS": "0",
        "MOLECULE_NO_COLOR": "1",
    }
    env.pop("ANSIBLE_CONFIG", None)  # molecule writes its own ansible.cfg for the scenario
    started = time.monotonic()
    result = subprocess.run(
        [str(BIN / "molecule"), "test", "-s", scenario],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=1450,
    )
    elapsed = time.monotonic() - started
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    assert result.returncode == 0, output[-8000:]
    for step in ("create", "prepare", "converge", "idempotence", "verify", "destroy"):
        assert re.search(rf"{step}: Executed: Successful", output), step
    assert re.search(r"idempotence: Executed: Successful", output)
    assert "passed" in output and "failed" not in re.findall(r"\d+ (passed|failed) in", output)
    print(f"molecule test -s {scenario}: {elapsed:.0f}s")
    # Nothing left behind: the scenario destroys its containers (named as create.yml names them).
    suffix = hashlib.sha1(str(ROOT).encode()).hexdigest()[:6]
    listing = subprocess.run(["lxc-ls", "-1"], capture_output=True, text=True, check=False).stdout
    for platform in SCENARIOS[scenario]:
        assert f"{platform}-{suffix}" not in listing.split(), listing
