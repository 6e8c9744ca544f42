"""Helpers that need Ansible's own Python API, run in a child process.

Importing ``ansible`` loads its configuration once per process (from ``ANSIBLE_CONFIG``), so these run in
a subprocess with the checkout's config instead of inside the caller's (a notebook may have imported
ansible with another config already). Input is JSON on stdin, output JSON (or vault text) on stdout.

``hostvars``: resolve inventory variables (templated, with extra vars on top) for the hosts of a pattern.
``vault-encrypt``: encrypt variables as a vault YAML document under a given password.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from regen.runner.errors import ExitCode

# Exit status of `hostvars` when Ansible cannot parse the inventory (a YAML error in a group_vars file).
INVENTORY_UNREADABLE = int(ExitCode.BAD_INPUT)


def _hostvars(request: dict[str, Any]) -> dict[str, Any]:
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=request["inventory"])
    if request.get("limit"):
        inventory.subset(request["limit"])
    manager = VariableManager(loader=loader, inventory=inventory)
    extra = request.get("extravars") or {}
    out: dict[str, Any] = {}
    for host in inventory.get_hosts(request.get("pattern") or "all"):
        variables = manager.get_vars(host=host, include_hostvars=False)
        variables.update(extra)
        templar = Templar(loader=loader, variables=variables)
        values: dict[str, Any] = {}
        for name in request.get("names", []):
            if name not in variables:
                continue
            try:
                values[name] = templar.template(variables[name])
            except Exception as exc:  # an unresolvable template is reported, not fatal
                values[name] = None
                values.setdefault("_errors", {})[name] = str(exc).splitlines()[0][:300]
        out[host.name] = json.loads(json.dumps(values, default=str))
    patterns = {p: [h.name for h in inventory.get_hosts(p)] for p in request.get("patterns", [])}
    return {"hosts": out, "patterns": patterns}


def _vault_encrypt(request: dict[str, Any]) -> str:
    import yaml
    from ansible.parsing.vault import VaultLib, VaultSecret

    secret = VaultSecret(request["password"].encode("utf-8"))
    vault = VaultLib([(request["vault_id"], secret)])
    plaintext = yaml.safe_dump(request["vars"], default_flow_style=False)
    return vault.encrypt(plaintext, secret, vault_id=request["vault_id"]).decode("ascii")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    request = json.loads(sys.stdin.read() or "{}")
    if argv == ["hostvars"]:
        from ansible.errors import AnsibleParserError

        try:
            hostvars = _hostvars(request)
        except AnsibleParserError as exc:  # the inventory itself is broken: the caller's input, exit 4
            print(f"the inventory cannot be read: {exc.message}", file=sys.stderr)
            return INVENTORY_UNREADABLE
        json.dump(hostvars, sys.stdout)
    elif argv == ["vault-encrypt"]:
        sys.stdout.write(_vault_encrypt(request))
    else:
        print(
            "usage: python -m regen.runner._ansible_helper hostvars|vault-encrypt < request.json",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
