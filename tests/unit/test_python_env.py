"""Pure decisions of the python_env role (module_utils/regen_venv.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.module_utils import regen_venv as pe

ROOT = Path(__file__).resolve().parents[2]
DEMO_LOCK = (ROOT / "envs" / "demo.lock").read_text()


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
        ("foo>=1.0\n", "not pinned with '=='"),
        ("--index-url https://x\nfoo==1\n", "pip option"),
        ("foo==1\nFoo==2\n", "pinned twice"),
        ("# only a comment\n", "no pinned requirement"),
    ],
)
def test_bad_locks_name_the_line(text: str, fragment: str) -> None:
    with pytest.raises(pe.LockError, match=fragment):
        pe.parse_lock(text, "envs/x.lock")


def test_markers_extras_and_names_normalize() -> None:
    lock = pe.parse_lock("Typing_Extensions==4.16.0\nsglang[all]==0.5.23 ; python_version >= '3.10'\n")
    assert lock["pins"] == {"typing-extensions": "4.16.0", "sglang": "0.5.23"}


def test_fingerprint_ignores_comments_but_not_pins_extras_or_python() -> None:
    lines = pe.parse_lock(DEMO_LOCK)["lines"]
    base = pe.fingerprint(lines, [], "3.11")
    recommented = pe.parse_lock("# a new header\n" + DEMO_LOCK)["lines"]
    assert pe.fingerprint(recommented, [], "3.11") == base
    assert pe.fingerprint(list(reversed(lines)), [], "3.11") == base
    bumped = [line.replace("tiktoken==0.14.0", "tiktoken==0.13.0") for line in lines]
    assert pe.fingerprint(bumped, [], "3.11") != base
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
