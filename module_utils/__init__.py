"""The logic the Ansible modules and the regen package share: one set of files, loaded two ways.

- Ansible: ansible.cfg's ``module_utils = module_utils`` puts this directory on Ansible's module_utils
  search path, so a module imports ``ansible.module_utils.regen_<name>``. Ansible ships a file to the
  target only when a module (or a file it ships) imports it; the rest of this directory stays behind.
- regen: ``src/regen/module_utils`` is a symbolic link to this directory, so the package imports the same
  files as ``regen.module_utils.regen_<name>``, from a checkout (the editable install) and from the wheel
  (setuptools and project_wheel copy what the link points at, so the wheel holds real files).

Two rules keep both ways working:
- Standard library only, and one file imports another relatively (``from .regen_config import X``,
  ``from . import regen_budget``): Ansible's dependency finder resolves a relative import to
  ``ansible.module_utils.<name>`` and ships that file; the package resolves it to
  ``regen.module_utils.<name>``. An absolute ``ansible.module_utils`` import would tie the package to
  ansible-core and to Ansible's search path (hosts that run jobs have neither).
- No side effects at import: both trees may import a file, and each import gets a module object of its
  own (compare values, not exception classes, across the two).

This file exists only so that setuptools packages the directory as ``regen.module_utils``; Ansible never
reads it. docs/module-utils-sharing.md explains the choice.
"""
