#!/usr/bin/python
"""Build, switch and verify one named Python environment from a pinned lock."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: python_venv
short_description: Build a venv from a pinned lock into a new directory, verify it, then switch to it
description:
  - The environment lives at O(path), a symlink to C(<path>.regen-<fingerprint>). A fingerprint of the
    lock, the extra packages and the interpreter's major.minor is kept inside the venv; when it matches,
    nothing is installed (changed=false) and the venv is only verified.
  - When it differs, a new venv is built next to the old one, its packages are checked (pip check),
    every module in O(verify_imports) is imported and, when O(tokenizer_model_path) exists, the model's
    tokenizer is loaded with C(trust_remote_code) in that venv's own interpreter. Only then is the
    symlink swapped (atomic rename) and the old directory removed; any failure leaves the previous venv
    in place and removes the half-built one.
  - O(wheels) are not part of the fingerprint; a new regen wheel is reinstalled into the current venv
    (changed=true, state C(updated)) instead of rebuilding several GB of pinned packages.
  - With O(manage=false) the venv at O(path) belongs to someone else (for example the controller's own
    venv in the local demo), and it is only verified.
  - Check mode reports whether a rebuild would happen and, with --diff, the package changes.
options:
  name:
    description: Environment name (used in messages and the manifest).
    type: str
    required: true
  path:
    description: Where the venv is reached (a symlink that this module owns).
    type: path
    required: true
  lock:
    description: Text of the pinned lock file.
    type: str
    default: ''
  lock_source:
    description: Where the lock came from (for messages).
    type: str
    default: ''
  extra_packages:
    description:
      - Packages installed on top of the lock, each pinned C(name==version). The lock is installed with
        hash checking, so these go in a second install without dependencies; one that repins a package
        of the lock, or is not pinned, is an error that names O(remedy_variable).
    type: list
    elements: str
    default: []
  remedy_variable:
    description: The inventory variable a user edits to add a package (named in messages).
    type: str
    default: ''
  wheels:
    description:
      - Wheel files on the host (the regen package) installed with C(--no-deps) on top of the lock, so
        every dependency still comes from the lock.
      - A wheel whose content changed is reinstalled in place, without rebuilding the venv.
    type: list
    elements: path
    default: []
  extra_paths:
    description: Directories added to the venv's import path through a .pth file.
    type: list
    elements: path
    default: []
  manage:
    description: Build the venv (true) or only verify an existing one (false).
    type: bool
    default: true
  python:
    description: Interpreter that creates the venv.
    type: str
    default: python3
  python_min:
    description: Oldest Python allowed; defaults to the lock's requires-python header.
    type: str
    default: ''
  installer:
    description: Installer to use; auto picks uv when it is found.
    type: str
    choices: [auto, uv, pip]
    default: auto
  uv:
    description: Path or name of the uv binary.
    type: str
    default: uv
  index_url:
    description: >-
      Package index URL; empty uses the installer's own configuration. It reaches the installer as
      C(PIP_INDEX_URL) or C(UV_INDEX_URL), never on its command line; a password in it is masked in
      the output.
    type: str
    default: ''
  offline:
    description: Install only from O(wheelhouse) (--no-index).
    type: bool
    default: false
  wheelhouse:
    description: Directory of wheels on the host.
    type: path
    default: ''
  min_free_mb:
    description: Free space (MiB) needed next to O(path) before a build starts.
    type: int
    default: 2048
  verify_imports:
    description: Modules that must import in the venv.
    type: list
    elements: str
    default: []
  tokenizer_model_path:
    description: Model directory whose tokenizer must load in the venv.
    type: str
    default: ''
  tokenizer_required:
    description: Fail when the model directory does not exist.
    type: bool
    default: false
  torch_devices:
    description: Also report the CUDA devices torch sees.
    type: bool
    default: false
  timeout:
    description: Seconds allowed for the install and for the probe.
    type: int
    default: 3600
  environment:
    description: Extra environment variables for the installer.
    type: dict
    default: {}
  compile_bytecode:
    description: Byte-compile every installed file at install time (pip's default, uv's opt-in).
    type: bool
    default: false
author: regen
"""

EXAMPLES = r"""
- name: Build the demo environment
  python_venv:
    name: demo
    path: /root/venvs/demo
    lock: "{{ lookup('ansible.builtin.file', 'envs/demo.lock') }}"
    verify_imports: [transformers, tiktoken]
    tokenizer_model_path: /root/models/regen-demo-kimi
"""

RETURN = r"""
state:
  description: created, updated, unchanged, verified, would_build or would_update.
  type: str
  returned: always
real_path:
  description: The directory behind the symlink.
  type: str
  returned: always
fingerprint:
  description: Fingerprint of what the venv is built from.
  type: str
  returned: always
installer:
  description: pip or uv.
  type: str
  returned: always
manifest:
  description: Package versions, Python, torch CUDA version and arch list, verification results.
  type: dict
  returned: success
verification:
  description: The raw probe result.
  type: dict
  returned: when probed
venv:
  description: Where the venv is reached (O(path); not named C(path), which Ansible would fill with file
    attributes, overwriting RV(state)).
  type: str
  returned: always
lock_pins:
  description: Number of pinned packages in the lock.
  type: int
  returned: when managed
previous:
  description: Where an unmanaged venv found at O(path) was moved (empty when there was none).
  type: str
  returned: after a build
python:
  description: Version of the venv's Python.
  type: str
  returned: always
changes:
  description: What a build or update changes (package diff, wheels reinstalled).
  type: list
  elements: str
  returned: when changed
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_files import file_sha256
from ansible.module_utils.regen_net import redact_url
from ansible.module_utils.regen_pyenv import probe_venv
from ansible.module_utils.regen_venv import (
    FINGERPRINT_FILE,
    LOCK_FILE,
    MANIFEST_FILE,
    STATE_DIR,
    WHEELS_FILE,
    LockError,
    build_dir_for,
    check_extras,
    classify_install_failure,
    fingerprint,
    index_url_environment,
    manifest,
    parse_lock,
    pins_diff,
    pip_check_problems,
    python_satisfies,
    tail,
    url_credentials,
    verification_errors,
    wheelhouse_missing,
)


class EnvFailure(Exception):
    def __init__(self, msg, **context):
        super().__init__(msg)
        self.msg = msg
        self.context = context


def _run(argv, timeout, env=None, cwd=None):
    try:
        proc = subprocess.run(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            env=env,
            cwd=cwd,
            check=False,
        )
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired as exc:
        output = exc.output.decode("utf-8", "replace") if exc.output else ""
        return 124, output + f"\n(timed out after {timeout}s)"
    return proc.returncode, proc.stdout.decode("utf-8", "replace")


def _python_version(python, timeout=60):
    rc, out = _run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"], timeout)
    return out.strip() if rc == 0 else None


def _read(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


class Environment:
    def __init__(self, module):
        self.module = module
        p = module.params
        self.p = p
        self.name = p["name"]
        self.path = p["path"].rstrip("/")
        self.env_entry = {
            "name": self.name,
            "path": self.path,
            "manage": p["manage"],
            "remedy_variable": p["remedy_variable"],
            "lock_source": p["lock_source"],
        }
        self.installer = "pip"
        self.extras = []  # the pinned extra packages not in the lock (check_extras), set by run()
        self.built_wheels = {}
        self.base_env = dict(os.environ)
        self.base_env.update({k: str(v) for k, v in (p["environment"] or {}).items()})
        self.base_env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        self.base_env["PYTHONNOUSERSITE"] = "1"

    # -- state of the host -------------------------------------------------------------------------

    def current_dir(self):
        """The directory behind `path`: (real dir or None, is_ours)."""
        if os.path.islink(self.path):
            target = os.path.realpath(self.path)
            return (target if os.path.isdir(target) else None), True
        if os.path.isdir(self.path):
            return self.path, os.path.isdir(os.path.join(self.path, STATE_DIR))
        return None, False

    def write_file(self, path, text):
        """Write through a temporary file in the same directory and Ansible's own atomic rename."""
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        self.module.atomic_move(tmp, path)

    def python_of(self, venv_dir):
        return os.path.join(venv_dir, "bin", "python")

    # -- probe ---------------------------------------------------------------------------------------

    def probe(self, venv_dir):
        python = self.python_of(venv_dir)
        if not os.path.exists(python):
            raise EnvFailure(
                f"{venv_dir} has no bin/python: environment '{self.name}' is not a venv (or is broken); "
                "remove it and re-run provisioning"
            )
        env = dict(self.base_env)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        env.pop("PYTHONPATH", None)
        result = probe_venv(
            python,
            imports=self.p["verify_imports"],
            model_path=self.p["tokenizer_model_path"] or None,
            required=self.p["tokenizer_required"],
            torch_devices=self.p["torch_devices"],
            timeout=self.p["timeout"],
            env=env,
            cwd="/",
        )
        if result["error"]:
            raise EnvFailure(
                f"the interpreter of environment '{self.name}' ({python}) could not run the verification "
                f"probe: {result['error']}"
            )
        del result["error"]
        return result

    def verify(self, venv_dir):
        result = self.probe(venv_dir)
        display = dict(self.env_entry)
        errors = verification_errors(result, display)
        return result, errors

    # -- installer -----------------------------------------------------------------------------------

    def pick_installer(self):
        wanted = self.p["installer"]
        uv = self.p["uv"]
        uv_path = uv if os.path.sep in uv else shutil.which(uv)
        if wanted == "uv" and not (uv_path and os.access(uv_path, os.X_OK)):
            raise EnvFailure(
                f"installer uv was requested for environment '{self.name}' but {uv} is not on this host; "
                "install uv or set python_env_installer: pip"
            )
        if wanted in ("uv", "auto") and uv_path and os.access(uv_path, os.X_OK):
            self.installer, self.uv_path = "uv", uv_path
        else:
            self.installer = "pip"

    def index_args(self):
        args = []
        if self.p["offline"]:
            args += ["--no-index", "--find-links", self.p["wheelhouse"]]
        return args  # an index URL goes through the environment (install_env), never the command line

    def install_env(self):
        if self.p["offline"]:
            return self.base_env
        return {**self.base_env, **index_url_environment(self.p["index_url"], self.installer)}

    def install_cmds(self, venv_dir, lock_path, extras):
        """The installs of a build: the lock in hash-checking mode (every file must match a hash the lock
        recorded), then the pinned extras without dependencies (the lock has no hash for them, and hash
        checking could not resolve anything); and the consistency check that follows."""
        python = self.python_of(venv_dir)
        if self.installer == "uv":
            base = [self.uv_path, "pip", "install", "--python", python, *self.index_args()]
            if self.p["offline"]:
                base.append("--offline")
            if self.p["compile_bytecode"]:
                base.append("--compile-bytecode")
            cmds = [[*base, "--require-hashes", "--no-deps", "-r", lock_path]]
            if extras:
                cmds.append([*base, "--no-deps", *extras])
            return cmds, [self.uv_path, "pip", "check", "--python", python]
        base = [
            python,
            "-m",
            "pip",
            "install",
            "--no-input",
            "--progress-bar",
            "off",
            "--retries",
            "1",
            "--timeout",
            "20",
            *self.index_args(),
        ]
        if not self.p["compile_bytecode"]:
            # Like uv's default: byte-compiling thousands of files at install time triples the install
            # time; Python compiles what is actually imported on first use.
            base.append("--no-compile")
        cmds = [[*base, "--require-hashes", "--no-deps", "-r", lock_path]]
        if extras:
            cmds.append([*base, "--no-deps", *extras])
        return cmds, [python, "-m", "pip", "check"]

    def wheel_install_cmd(self, venv_dir):
        """Install O(wheels) without their dependencies (the lock holds those), replacing what is there.

        Separate from install_cmds: these are local files, not pinned index requirements."""
        python = self.python_of(venv_dir)
        if self.installer == "uv":
            return [
                self.uv_path,
                "pip",
                "install",
                "--python",
                python,
                "--no-index",
                "--no-deps",
                "--reinstall",
                *self.p["wheels"],
            ]
        return [
            python,
            "-m",
            "pip",
            "install",
            "--no-input",
            "--progress-bar",
            "off",
            "--no-index",
            "--no-deps",
            "--force-reinstall",
            "--no-compile",
            *self.p["wheels"],
        ]

    def wheel_digests_or_pending(self):
        """wheel_digests(), except in check mode, where a wheel the role would copy first reads as new."""
        if self.module.check_mode and not all(os.path.isfile(path) for path in self.p["wheels"]):
            return {os.path.basename(path): "(not copied yet)" for path in self.p["wheels"]}
        return self.wheel_digests()

    def wheel_digests(self):
        """{wheel file name: sha256} of O(wheels); a wheel that is not on the host is a clear error."""
        digests = {}
        for path in self.p["wheels"]:
            if not os.path.isfile(path):
                raise EnvFailure(
                    f"the wheel {path} for environment '{self.name}' is not on this host; the python_env "
                    "role copies it there before this task (run the whole role, not this task alone)"
                )
            digests[os.path.basename(path)] = file_sha256(path)
        return digests

    def install_wheels(self, venv_dir, digests):
        rc, out = _run(self.wheel_install_cmd(venv_dir), self.p["timeout"], env=self.base_env)
        if rc != 0:
            raise EnvFailure(
                f"installing {', '.join(sorted(digests))} into environment '{self.name}' failed: {tail(out)}",
                output_tail=tail(out, 30),
            )
        self.write_file(
            os.path.join(venv_dir, STATE_DIR, WHEELS_FILE),
            json.dumps(digests, indent=2, sort_keys=True) + "\n",
        )

    def create_venv(self, python, venv_dir):
        if self.installer == "uv":
            rc, out = _run([self.uv_path, "venv", "--python", python, venv_dir], 600, env=self.base_env)
        else:
            rc, out = _run([python, "-m", "venv", venv_dir], 600, env=self.base_env)
        if rc != 0:
            hint = ""
            if "ensurepip" in out or "venv" in out:
                hint = " (on Debian/Ubuntu install the python3-venv package)"
            raise EnvFailure(
                f"creating the venv {venv_dir} for environment '{self.name}' with {python} failed{hint}: "
                f"{tail(out)}"
            )

    # -- main ----------------------------------------------------------------------------------------

    def run(self):
        p = self.p
        if not p["manage"]:
            return self.run_verify_only()
        try:
            lock = parse_lock(p["lock"], p["lock_source"] or f"lock of {self.name}")
            self.extras = check_extras(p["extra_packages"], lock, p["remedy_variable"])
        except LockError as exc:
            raise EnvFailure(f"environment '{self.name}': {exc}") from None

        python = p["python"]
        version = _python_version(python)
        if version is None:
            raise EnvFailure(
                f"the interpreter {python} for environment '{self.name}' does not run on this host; install "
                "it or set python of the entry to an existing Python"
            )
        needed = (p["python_min"] and (">=" + p["python_min"])) or lock["requires_python"]
        if needed and not python_satisfies(version, needed):
            raise EnvFailure(
                "{} is Python {}, but environment '{}' needs Python {} (from {}); install a newer "
                "Python and set python of the entry to it".format(
                    python,
                    version,
                    self.name,
                    needed,
                    "python_min" if p["python_min"] else p["lock_source"] or "the lock",
                )
            )
        py_minor = ".".join(version.split(".")[:2])
        digest = fingerprint(lock["lines"], p["extra_packages"], py_minor, p["extra_paths"])
        current, ours = self.current_dir()
        current_digest = None
        if current and ours:
            current_digest = (_read(os.path.join(current, STATE_DIR, FINGERPRINT_FILE)) or "").strip()
        result = {
            "changed": False,
            "venv": self.path,
            "fingerprint": digest,
            "python": version,
            "real_path": current or "",
            "lock_pins": len(lock["pins"]),
        }

        if current and current_digest == digest:
            self.pick_installer()
            wheels = self.wheel_digests_or_pending()
            installed = json.loads(_read(os.path.join(current, STATE_DIR, WHEELS_FILE)) or "{}")
            if wheels and wheels != installed:
                result.update(changed=True, changes=[f"reinstall {name}" for name in sorted(wheels)])
                if self.module.check_mode:
                    result.update(state="would_update", installer=self.installer)
                    return result
                self.install_wheels(current, wheels)
            probe, errors = self.verify(current)
            if errors:
                raise EnvFailure("; ".join(errors), verification=probe, state="unchanged")
            # The manifest is rebuilt from this run's probe (the tokenizer smoke may have changed since the
            # build); only the installer that built the venv comes from the record kept inside it.
            try:
                installer = json.loads(_read(os.path.join(current, STATE_DIR, MANIFEST_FILE)) or "{}")[
                    "installer"
                ]
            except (ValueError, KeyError):
                installer = self.installer
            result.update(
                state="updated" if result["changed"] else "unchanged",
                installer=installer,
                verification=probe,
                manifest=manifest(self.env_entry, probe, digest, installer, wheels),
            )
            return result

        old_pins = {}
        if current and ours:
            old_lock = _read(os.path.join(current, STATE_DIR, LOCK_FILE)) or ""
            try:
                # A venv built before the locks carried hashes has an unhashed record; its pins still count.
                old_pins = parse_lock(old_lock, require_hashes=False)["pins"] if old_lock.strip() else {}
            except LockError:
                old_pins = {}
        diff_lines = pins_diff(old_pins, lock["pins"])
        result["diff"] = {
            "before_header": "{} ({})".format(self.path, current or "absent"),
            "after_header": f"{self.path} ({build_dir_for(self.path, digest)})",
            "before": "".join("{}=={}\n".format(*kv) for kv in sorted(old_pins.items())),
            "after": "".join("{}=={}\n".format(*kv) for kv in sorted(lock["pins"].items())),
        }
        result["changes"] = (
            diff_lines if current else [f"create {self.path} with {len(lock['pins'])} packages"]
        )
        result["changed"] = True
        if current and not ours:
            result["changes"].append(
                f"move the existing unmanaged {self.path} aside to {self.path}.regen-previous"
            )
        if self.module.check_mode:
            result.update(state="would_build", installer=p["installer"])
            return result

        self.pick_installer()
        new_dir = build_dir_for(self.path, digest)
        parent = os.path.dirname(self.path) or "/"
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o755)
        free_mb = shutil.disk_usage(parent).free // (1024 * 1024)
        if free_mb < p["min_free_mb"]:
            raise EnvFailure(
                f"not enough disk for environment '{self.name}' on {parent}: {free_mb} MiB free, "
                f"{p['min_free_mb']} MiB needed (min_free_mb of the entry); free space or move path to a "
                "larger disk",
                free_mb=free_mb,
            )
        if p["offline"]:
            if not p["wheelhouse"] or not os.path.isdir(p["wheelhouse"]):
                raise EnvFailure(
                    "offline mode for environment '{}' needs a wheelhouse directory, and {!r} is not "
                    "one on this host".format(self.name, p["wheelhouse"])
                )
            missing = wheelhouse_missing(lock["pins"], os.listdir(p["wheelhouse"]))
            if missing:
                raise EnvFailure(
                    f"the wheelhouse {p['wheelhouse']} lacks {len(missing)} pinned package(s) of environment "
                    f"'{self.name}': {', '.join(missing[:10])}; rebuild it on the controller "
                    "(python_env_wheelhouse_build: true)",
                    missing=missing,
                )

        if os.path.lexists(new_dir):
            # A build of the same fingerprint that never got switched to (a crash, or a failed verify).
            shutil.rmtree(new_dir, ignore_errors=True)
        try:
            probe = self.build(python, new_dir, lock, digest)
        except BaseException:
            shutil.rmtree(new_dir, ignore_errors=True)
            raise
        record = manifest(self.env_entry, probe, digest, self.installer, self.built_wheels)
        self.write_file(
            os.path.join(new_dir, STATE_DIR, MANIFEST_FILE),
            json.dumps(record, indent=2, sort_keys=True) + "\n",
        )
        self.write_file(os.path.join(new_dir, STATE_DIR, FINGERPRINT_FILE), digest + "\n")
        previous = self.switch(new_dir, current, ours)
        result.update(
            state="updated" if current else "created",
            installer=self.installer,
            real_path=new_dir,
            previous=previous or "",
            verification=probe,
            manifest=record,
        )
        return result

    def build(self, python, new_dir, lock, digest):
        p = self.p
        self.create_venv(python, new_dir)
        state = os.path.join(new_dir, STATE_DIR)
        os.makedirs(state, exist_ok=True)
        lock_path = os.path.join(state, LOCK_FILE)
        self.write_file(lock_path, p["lock"] if p["lock"].endswith("\n") else p["lock"] + "\n")
        if p["extra_paths"]:
            self.write_pth(new_dir)
        installs, check = self.install_cmds(new_dir, lock_path, self.extras)
        index = "wheelhouse {}".format(p["wheelhouse"]) if p["offline"] else redact_url(p["index_url"])
        for argv in installs:
            rc, out = _run(argv, p["timeout"], env=self.install_env())
            if rc != 0:
                raise EnvFailure(
                    classify_install_failure(out, self.name, index, p["offline"], p["wheelhouse"])
                    + " [previous venv left in place]",
                    output_tail=tail(out, 30),
                )
        self.built_wheels = self.wheel_digests()
        if self.built_wheels:
            self.install_wheels(new_dir, self.built_wheels)
        rc, out = _run(check, 600, env=self.base_env)
        problems = pip_check_problems(out)
        if rc != 0 or problems:
            extras_hint = (
                " (the extra packages {} are installed without dependencies: list what they need beyond the "
                "lock in {} too)".format(", ".join(self.extras), p["remedy_variable"] or "extra_packages")
                if self.extras
                else ""
            )
            raise EnvFailure(
                "the lock of environment '{}' does not resolve: its pinned packages are inconsistent "
                "({}); re-resolve it with envs/resolve.sh{} [previous venv left in place]".format(
                    self.name, "; ".join(problems[:8]) or tail(out), extras_hint
                ),
                output_tail=tail(out, 30),
            )
        probe, errors = self.verify(new_dir)
        if errors:
            raise EnvFailure(
                "; ".join(errors) + f" [the new build was removed; the previous venv at {self.path} is left "
                "in place]",
                verification=probe,
            )
        return probe

    def write_pth(self, venv_dir):
        rc, out = _run(
            [self.python_of(venv_dir), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 120
        )
        if rc != 0:
            raise EnvFailure(f"cannot locate site-packages of {venv_dir}: {tail(out)}")
        self.write_file(
            os.path.join(out.strip(), "regen-extra-paths.pth"), "\n".join(self.p["extra_paths"]) + "\n"
        )

    def switch(self, new_dir, current, ours):
        """Point `path` at new_dir with one rename, then drop the directory it pointed at before.

        Returns where an unmanaged venv that sat at `path` was moved (it is kept: we did not build it)."""
        kept = None
        remove = None
        if os.path.isdir(self.path) and not os.path.islink(self.path):
            # A real directory sits at path (a hand-made venv): move it aside first. This is the one
            # non-atomic moment; with a symlink at path (every later run) the switch is a single rename.
            aside = self.path + ".regen-previous"
            if os.path.lexists(aside):
                raise EnvFailure(
                    f"{self.path} is an unmanaged directory and {aside} already exists; move one of them "
                    f"away [the new build at {new_dir} is verified and left in place]"
                )
            os.rename(self.path, aside)
            if ours:
                remove = aside
            else:
                kept = aside
        elif current and ours and current != new_dir:
            remove = current
        swap = self.path + ".regen-swap"
        if os.path.lexists(swap):
            os.unlink(swap)
        os.symlink(new_dir, swap)
        os.replace(swap, self.path)
        if remove:
            shutil.rmtree(remove, ignore_errors=True)
        return kept

    def run_verify_only(self):
        if not os.path.isdir(self.path):
            raise EnvFailure(
                f"environment '{self.name}' is not managed by regen and {self.path} does not exist; create "
                "that venv or set manage: true with a lock"
            )
        probe, errors = self.verify(self.path)
        if errors:
            raise EnvFailure("; ".join(errors), verification=probe)
        record = manifest(self.env_entry, probe, "", "external")
        return {
            "changed": False,
            "state": "verified",
            "venv": self.path,
            "real_path": os.path.realpath(self.path),
            "fingerprint": "",
            "installer": "external",
            "verification": probe,
            "manifest": record,
            "python": (probe.get("python") or {}).get("version"),
        }


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            path=dict(type="path", required=True),
            lock=dict(type="str", default=""),
            lock_source=dict(type="str", default=""),
            extra_packages=dict(type="list", elements="str", default=[]),
            remedy_variable=dict(type="str", default=""),
            wheels=dict(type="list", elements="path", default=[]),
            extra_paths=dict(type="list", elements="path", default=[]),
            manage=dict(type="bool", default=True),
            python=dict(type="str", default="python3"),
            python_min=dict(type="str", default=""),
            installer=dict(type="str", choices=["auto", "uv", "pip"], default="auto"),
            uv=dict(type="str", default="uv"),
            index_url=dict(type="str", default=""),
            offline=dict(type="bool", default=False),
            wheelhouse=dict(type="path", default=""),
            min_free_mb=dict(type="int", default=2048),
            verify_imports=dict(type="list", elements="str", default=[]),
            tokenizer_model_path=dict(type="str", default=""),
            tokenizer_required=dict(type="bool", default=False),
            torch_devices=dict(type="bool", default=False),
            timeout=dict(type="int", default=3600),
            environment=dict(type="dict", default={}),
            compile_bytecode=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    if module.params["manage"] and not module.params["lock"].strip():
        module.fail_json(
            msg="environment '{}' is managed but has no lock text; set lock of the entry to a file "
            "under envs/".format(module.params["name"])
        )
    # A password in the index URL stays out of everything the module returns (invocation included).
    module.no_log_values.update(url_credentials(module.params["index_url"]))
    try:
        result = Environment(module).run()
    except EnvFailure as exc:
        module.fail_json(
            msg=exc.msg, environment=module.params["name"], venv=module.params["path"], **exc.context
        )
    except OSError as exc:
        module.fail_json(
            msg="environment '{}' at {}: {}".format(module.params["name"], module.params["path"], exc)
        )
    tokenizer = (result.get("verification") or {}).get("tokenizer") or {}
    if tokenizer and not tokenizer.get("attempted"):
        module.warn(
            f"tokenizer smoke of environment '{module.params['name']}' skipped: "
            f"{tokenizer.get('model_path')} does not exist on this host yet (set tokenizer_required: true to "
            "make that an error)"
        )
    module.exit_json(**result)


if __name__ == "__main__":
    sys.exit(main())
