"""Pure decisions of the python_env role (module_utils/regen_venv.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.module_utils import regen_venv as pe

ROOT = Path(__file__).resolve().parents[2]
DEMO_LOCK = (ROOT / "envs" / "demo.lock").read_text()
HOST_LOCKS = ("demo", "demo-serving", "jobs", "serving", "training")
SHA = "sha256:" + "ab" * 32
OTHER_SHA = "sha256:" + "cd" * 32


# -- locks -------------------------------------------------------------------------------------------


def test_the_real_locks_parse_and_carry_their_target() -> None:
    for name, pin in (("demo", "tiktoken"), ("serving", "sglang"), ("training", "specforge")):
        lock = pe.parse_lock((ROOT / "envs" / f"{name}.lock").read_text(), name)
        assert pin in lock["pins"], name
        assert lock["requires_python"] == ">=3.10"
        assert lock["python"] == "3.11"
        assert lock["platform"].startswith("x86_64-manylinux_2_")
    demo = pe.parse_lock(DEMO_LOCK)
    assert demo["pins"]["tiktoken"] == "0.14.0" and demo["pins"]["transformers"] == "5.24.0"
    assert "torch" not in demo["pins"]  # the demo set stays small
    jobs = pe.parse_lock((ROOT / "envs" / "jobs.lock").read_text(), "jobs")["pins"]
    # A generation host that does not serve: the tokenizer and the job's client, at the serving set's
    # versions (the same job code runs in both), and no engine.
    serving = pe.parse_lock((ROOT / "envs" / "demo-serving.lock").read_text())["pins"]
    assert {name: jobs[name] for name in ("transformers", "tiktoken", "aiohttp")} == {
        name: serving[name] for name in ("transformers", "tiktoken", "aiohttp")}
    assert "torch" not in jobs


def test_every_lock_pins_every_package_with_the_hashes_of_its_files() -> None:
    paths = [ROOT / "envs" / f"{name}.lock" for name in HOST_LOCKS]
    paths.append(ROOT / "requirements" / "controller.lock")
    for path in paths:
        lock = pe.parse_lock(path.read_text(), path.name)  # require_hashes: a pin without one raises
        assert lock["pins"] and set(lock["hashes"]) == set(lock["pins"]), path
        for name, hashes in lock["hashes"].items():
            assert hashes and all(h.startswith("sha256:") and len(h) == 7 + 64 for h in hashes), (path, name)
        assert lock["python"] == "3.11" and lock["platform"].startswith("x86_64-manylinux_2_"), path


def test_the_controller_lock_holds_what_controller_in_asks_for() -> None:
    wanted = pe.parse_lock(
        (ROOT / "requirements" / "controller.in").read_text(), "controller.in", require_hashes=False
    )["pins"]
    locked = pe.parse_lock((ROOT / "requirements" / "controller.lock").read_text())["pins"]
    assert {name: locked.get(name) for name in wanted} == wanted
    assert locked["torch"].endswith("+cpu")  # the CPU build from find-links, not PyPI's CUDA one


def test_the_venvs_that_run_jobs_pin_psutil_and_matplotlib_at_the_controller_versions() -> None:
    controller = pe.parse_lock((ROOT / "requirements" / "controller.lock").read_text())["pins"]
    for name in HOST_LOCKS:
        pins = pe.parse_lock((ROOT / "envs" / f"{name}.lock").read_text(), name)["pins"]
        for package in ("psutil", "matplotlib"):
            assert pins.get(package) == controller[package], (name, package)


def test_serving_and_training_pin_different_stacks() -> None:
    serving = pe.parse_lock((ROOT / "envs" / "serving.lock").read_text())["pins"]
    training = pe.parse_lock((ROOT / "envs" / "training.lock").read_text())["pins"]
    # SpecForge pins its own sglang/torch/transformers: the reason training has its own venv.
    assert serving["sglang"] != training["sglang"]
    assert serving["torch"] != training["torch"]
    for pins in (serving, training):
        assert pins["nvidia-cuda-runtime"].startswith("13.")
        assert "tiktoken" in pins and "sentencepiece" in pins


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (f"foo>=1.0 --hash={SHA}\n", r"line 1: 'foo>=1.0' is not pinned with '=='"),
        (f"--index-url https://x\nfoo==1 --hash={SHA}\n", "line 1: .* is a pip option"),
        (f"foo==1 --index-url https://x --hash={SHA}\n", "'--index-url https://x' is a pip option"),
        (f"foo==1 --hash={SHA}\nFoo==2 --hash={OTHER_SHA}\n", "line 2: Foo is pinned twice"),
        ("# only a comment\n", "no pinned requirement"),
        (f"foo==1 --hash={SHA}\nbar==2\n", r"line 2: bar==2 has no --hash; .*--require-hashes"),
        (f"foo==1 \\\n    --hash={SHA}\n    --hash={OTHER_SHA}\n", "line 3: .* --hash without a requirement"),
        ("foo==1 --hash=sha256:abc\n", "is not a digest pip can check"),
        ("foo==1 --hash=md5:" + "ab" * 16 + "\n", "is not a digest pip can check"),
    ],
)
def test_bad_locks_name_the_line(text: str, fragment: str) -> None:
    with pytest.raises(pe.LockError, match=fragment):
        pe.parse_lock(text, "envs/x.lock")


def test_markers_extras_and_names_normalize() -> None:
    lock = pe.parse_lock(
        f"Typing_Extensions==4.16.0 --hash={SHA}\n"
        f"sglang[all]==0.5.23 ; python_version >= '3.10' \\\n    --hash={SHA} \\\n    --hash={OTHER_SHA}\n"
    )
    assert lock["pins"] == {"typing-extensions": "4.16.0", "sglang": "0.5.23"}
    assert lock["hashes"]["sglang"] == [SHA, OTHER_SHA]


def test_hash_lines_continue_the_pin_above_them_as_pip_reads_them() -> None:
    text = (
        f"# header\nfoo==1.0 \\\n    --hash={OTHER_SHA} \\\n    --hash={SHA}\n"
        f"    # via bar\nbar==2 --hash={SHA}\n"
    )
    lock = pe.parse_lock(text)
    assert lock["pins"] == {"foo": "1.0", "bar": "2"}
    assert lock["hashes"] == {"foo": [SHA, OTHER_SHA], "bar": [SHA]}
    # Normalized: hashes sorted, one line per pin, so reordering a pin's hashes is no change.
    assert lock["lines"] == [f"foo==1.0 --hash={SHA} --hash={OTHER_SHA}", f"bar==2 --hash={SHA}"]


def test_an_old_venv_record_without_hashes_still_gives_its_pins() -> None:
    assert pe.parse_lock("foo==1\nbar==2\n", require_hashes=False)["pins"] == {"foo": "1", "bar": "2"}
    with pytest.raises(pe.LockError, match="has no --hash"):
        pe.parse_lock("foo==1\n")


def test_requirements_text_is_a_hashed_subset_that_parses_back() -> None:
    demo = pe.parse_lock(DEMO_LOCK)
    subset = pe.requirements_text(demo, {"tqdm", "regex"})
    again = pe.parse_lock(subset)
    assert set(again["pins"]) == {"tqdm", "regex"}
    assert again["hashes"]["tqdm"] == demo["hashes"]["tqdm"]
    assert subset.startswith("regex==") and " \\\n    --hash=sha256:" in subset
    assert pe.parse_lock(pe.requirements_text(demo))["lines"] == demo["lines"]


def test_extras_must_be_pinned_and_must_not_repin_the_lock() -> None:
    demo = pe.parse_lock(DEMO_LOCK)
    assert pe.check_extras(["sentencepiece==0.2.3", "tiktoken==0.14.0"], demo, "regen_demo_packages") == [
        "sentencepiece==0.2.3"  # tiktoken is in the lock at that version already: nothing to add
    ]
    with pytest.raises(pe.LockError, match=r"regen_demo_packages: 'sentencepiece' is not pinned"):
        pe.check_extras(["sentencepiece"], demo, "regen_demo_packages")
    with pytest.raises(pe.LockError, match=r"regen_demo_packages: 'sentencepiece>=0.2' is not pinned"):
        pe.check_extras(["sentencepiece>=0.2"], demo, "regen_demo_packages")
    with pytest.raises(
        pe.LockError,
        match=r"regen_demo_packages: 'tqdm==4.67.1' conflicts with the lock, which pins tqdm==4.70.1",
    ):
        pe.check_extras(["tqdm==4.67.1"], demo, "regen_demo_packages")
    with pytest.raises(pe.LockError, match="extra_packages of this entry in python_env_envs"):
        pe.check_extras(["x"], demo)


def test_fingerprint_ignores_comments_but_not_pins_extras_or_python() -> None:
    lines = pe.parse_lock(DEMO_LOCK)["lines"]
    base = pe.fingerprint(lines, [], "3.11")
    recommented = pe.parse_lock("# a new header\n" + DEMO_LOCK)["lines"]
    assert pe.fingerprint(recommented, [], "3.11") == base
    assert pe.fingerprint(list(reversed(lines)), [], "3.11") == base
    bumped = [line.replace("tiktoken==0.14.0", "tiktoken==0.13.0") for line in lines]
    assert pe.fingerprint(bumped, [], "3.11") != base
    rehashed = pe.parse_lock(DEMO_LOCK.replace("--hash=sha256:c293e525", "--hash=sha256:00000000"))["lines"]
    assert pe.fingerprint(rehashed, [], "3.11") != base  # same versions, other files: a rebuild
    assert pe.fingerprint(lines, ["sentencepiece==0.2.3"], "3.11") != base
    assert pe.fingerprint(lines, [], "3.12") != base
    assert pe.build_dir_for("/root/venv_sglang/", base) == f"/root/venv_sglang.regen-{base[:12]}"


@pytest.mark.parametrize(
    ("version", "spec", "ok"),
    [
        ("3.11.2", ">=3.10", True),
        ("3.9.18", ">=3.10", False),
        ("3.10.0", ">=3.10,<3.14", True),
        ("3.14.0", ">=3.10,<3.14", False),
        ("3.12.1", "==3.12.*", True),
        ("3.11.9", "~=3.10", True),
        ("3.11.9", "", True),
    ],
)
def test_python_satisfies(version: str, spec: str, ok: bool) -> None:
    assert pe.python_satisfies(version, spec) is ok


# -- wheelhouse ----------------------------------------------------------------------------------------


def test_wheelhouse_missing_matches_wheel_and_sdist_names() -> None:
    pins = {
        "tiktoken": "0.14.0",
        "typing-extensions": "4.16.0",
        "pyyaml": "6.0.4",
        "certifi": "2026.10.19.post1",
        "foo": "1.0",
    }
    files = [
        "tiktoken-0.14.0-cp311-cp311-manylinux_2_28_x86_64.whl",
        "typing_extensions-4.16.0-py3-none-any.whl",
        "PyYAML-6.0.4-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "certifi-2026.10.19.post1-py3-none-any.whl",
        "foo-1.0.tar.gz",
        "unrelated.txt",
    ]
    assert pe.wheelhouse_missing(pins, files) == []
    assert pe.wheelhouse_missing(pins, files[1:]) == ["tiktoken==0.14.0"]
    assert pe.wheelhouse_missing({"tiktoken": "0.13.0"}, files) == ["tiktoken==0.13.0"]


def test_download_platforms_cover_older_manylinux_tags() -> None:
    tags = pe.download_platforms("x86_64-manylinux_2_28")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert "manylinux2014_x86_64" in tags
    assert pe.download_platforms("") == []


# -- failures ------------------------------------------------------------------------------------------

PIP_UNREACHABLE = """WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) \
after connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPConnection object \
at 0x7f>: Failed to establish a new connection: [Errno 111] Connection refused')': /simple/tiktoken/
ERROR: Could not find a version that satisfies the requirement tiktoken==0.14.0 (from versions: none)
ERROR: No matching distribution found for tiktoken==0.14.0"""

PIP_NO_SUCH_VERSION = """ERROR: Could not find a version that satisfies the requirement tiktoken==99.0 \
(from versions: 0.13.0, 0.14.0)
ERROR: No matching distribution found for tiktoken==99.0"""


def test_unreachable_index_is_named() -> None:
    msg = pe.classify_install_failure(PIP_UNREACHABLE, "serving", "http://127.0.0.1:9/simple", False, "")
    assert "cannot be reached" in msg and "http://127.0.0.1:9/simple" in msg and "'serving'" in msg
    assert "python_env_offline" in msg


def test_pin_that_does_not_exist_is_a_lock_that_does_not_resolve() -> None:
    msg = pe.classify_install_failure(PIP_NO_SUCH_VERSION, "demo", "", False, "")
    assert "does not resolve" in msg and "tiktoken==99.0" in msg and "envs/resolve.sh" in msg


def test_offline_miss_names_the_wheelhouse() -> None:
    msg = pe.classify_install_failure(PIP_NO_SUCH_VERSION, "demo", "", True, "/root/regen/wheelhouse/demo")
    assert "/root/regen/wheelhouse/demo" in msg and "tiktoken==99.0" in msg


# What pip 26.3 and uv 0.13.8 print when a file's sha256 is not among the lock's hashes (captured from real
# runs against the demo wheelhouse with a lock whose tqdm hash was replaced).
PIP_HASH_MISMATCH = """Processing /w/demo/tqdm-4.70.1-py3-none-any.whl (from -r /v/lock.txt (line 1))
ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE. If you have updated the package \
versions, please update the hashes. Otherwise, examine the package contents carefully; someone may have \
tampered with them.
    tqdm==4.70.1 from file:///w/demo/tqdm-4.70.1-py3-none-any.whl (from -r /v/lock.txt (line 1)):
        Expected sha256 0000000000000000000000000000000000000000000000000000000000000000
             or sha256 1111111111111111111111111111111111111111111111111111111111111111
             Got        c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73
"""

UV_HASH_MISMATCH = """Resolved 1 package in 1ms
error: Failed to download `tqdm==4.70.1`
  cause: Hash mismatch for `tqdm==4.70.1`

         Expected:
           sha256:0000000000000000000000000000000000000000000000000000000000000000

         Computed:
           sha256:c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73"""


@pytest.mark.parametrize("output", [PIP_HASH_MISMATCH, UV_HASH_MISMATCH])
def test_a_file_the_lock_has_no_hash_for_is_named_with_its_digest(output: str) -> None:
    offline = pe.classify_install_failure(output, "demo", "", True, "/w/demo")
    assert offline.startswith("the file for tqdm==4.70.1 from the wheelhouse /w/demo")
    assert "c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73" in offline
    assert "'demo'" in offline and "delete that file from the controller's wheelhouse" in offline
    online = pe.classify_install_failure(output, "demo", "https://mirror/simple", False, "")
    assert "from the index https://mirror/simple" in online and "python_env_index_url" in online
    assert pe.hash_mismatch(PIP_UNREACHABLE) is None


def test_a_pin_without_hash_is_sent_back_to_the_resolver() -> None:
    uv = (
        "error: In `--require-hashes` mode, all requirements must have a hash, but none were provided "
        "for: foo==1"
    )
    pip = (
        "ERROR: Hashes are required in --require-hashes mode, but they are missing from some requirements."
        " ... tampering.\n    foo==1 --hash=sha256:ab"
    )
    for output in (uv, pip):
        msg = pe.classify_install_failure(output, "demo", "", False, "")
        assert msg.startswith("foo==1 has no --hash in the lock of environment 'demo'")
        assert "envs/resolve.sh" in msg


def test_disk_full_is_named() -> None:
    msg = pe.classify_install_failure("OSError: [Errno 28] No space left on device", "serving", "", False, "")
    assert "disk filled up" in msg and "min_free_mb" in msg


def test_pip_check_problems() -> None:
    out = (
        "transformers 5.24.0 requires tokenizers, which is not installed.\n"
        "huggingface-hub 2.4.0 has requirement fsspec>=2023, but you have fsspec 2020.1.\n"
    )
    assert len(pe.pip_check_problems(out)) == 2
    assert pe.pip_check_problems("No broken requirements found.\n") == []


# -- verification --------------------------------------------------------------------------------------

TRANSFORMERS_MISSING = (
    "ImportError: This modeling file requires the following packages that were not found "
    "in your environment: tiktoken. Run `pip install tiktoken`"
)


def _env(**extra: object) -> dict:
    return {
        "name": "serving",
        "path": "/root/venv_sglang",
        "manage": True,
        "remedy_variable": "regen_serving_packages",
        "lock_source": "envs/serving.lock",
        **extra,
    }


def test_missing_modules_from_both_error_shapes() -> None:
    assert pe.missing_modules(TRANSFORMERS_MISSING) == ["tiktoken"]
    assert pe.missing_modules("ModuleNotFoundError: No module named 'tiktoken.load'", None) == ["tiktoken"]
    assert pe.missing_modules("x", "sentencepiece") == ["sentencepiece"]
    assert pe.missing_modules("requires ... not found in your environment: tiktoken, blobfile. Run") == [
        "tiktoken",
        "blobfile",
    ]


def test_tokenizer_failure_names_venv_package_and_variable() -> None:
    probe = {
        "imports": {"transformers": {"ok": True}},
        "tokenizer": {
            "attempted": True,
            "ok": False,
            "model_path": "/root/models/Kimi-K2.6",
            "error": TRANSFORMERS_MISSING,
            "missing_module": None,
        },
    }
    errors = pe.verification_errors(probe, _env())
    assert errors == [
        "tiktoken is not installed in /root/venv_sglang (environment 'serving'), so the tokenizer of "
        "/root/models/Kimi-K2.6 cannot load there (AutoTokenizer with trust_remote_code); add tiktoken to "
        "regen_serving_packages (or pin it in the lock envs/serving.lock and re-resolve it with "
        "envs/resolve.sh)"
    ]


def test_import_failures_are_reported_per_module() -> None:
    probe = {
        "imports": {
            "tiktoken": {
                "ok": False,
                "error_type": "ModuleNotFoundError",
                "error": "No module named 'tiktoken'",
                "missing_module": "tiktoken",
            },
            "yaml": {"ok": False, "error": "No module named 'yaml'", "missing_module": "yaml"},
            "sglang": {"ok": False, "error": "No module named 'zmq'", "missing_module": "zmq"},
            "torch": {
                "ok": False,
                "error_type": "OSError",
                "error": "libcuda.so.1: cannot open shared object file",
                "missing_module": None,
            },
            "transformers": {"ok": True, "version": "5.24.0"},
        }
    }
    errors = pe.verification_errors(probe, _env())
    assert any(e.startswith("tiktoken is not installed in /root/venv_sglang") for e in errors)
    assert any(e.startswith("PyYAML is not installed") for e in errors)
    assert any("sglang cannot be imported" in e and "zmq is missing" in e for e in errors)
    assert any("torch cannot be imported" in e and "libcuda.so.1" in e for e in errors)
    assert len(errors) == 4


def test_unmanaged_venv_gets_a_pip_remedy() -> None:
    probe = {
        "imports": {
            "tiktoken": {"ok": False, "error": "No module named 'tiktoken'", "missing_module": "tiktoken"}
        }
    }
    [error] = pe.verification_errors(probe, _env(manage=False, path="/opt/venv"))
    assert "/opt/venv/bin/python -m pip install tiktoken" in error


def test_required_model_that_is_absent_fails_and_optional_one_does_not() -> None:
    absent = {"tokenizer": {"attempted": False, "ok": False, "required": True, "model_path": "/m"}}
    assert "does not exist" in pe.verification_errors(absent, _env())[0]
    absent["tokenizer"]["required"] = False
    assert pe.verification_errors(absent, _env()) == []


def test_pins_diff_and_manifest_are_deterministic() -> None:
    diff = pe.pins_diff({"a": "1", "b": "1", "c": "1"}, {"a": "1", "b": "2", "d": "1"})
    assert diff == ["~ b 1 -> 2", "- c==1", "+ d==1"]
    probe = {
        "python": {"version": "3.11.2"},
        "packages": {"b": "1", "a": "2"},
        "torch": None,
        "imports": {"x": {"ok": True, "version": "1"}},
        "tokenizer": None,
    }
    first = pe.manifest(_env(), probe, "f" * 64, "pip")
    assert list(first["packages"]) == ["a", "b"]
    assert first == pe.manifest(_env(), dict(probe), "f" * 64, "pip")
