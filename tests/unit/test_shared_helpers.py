"""The helpers module_utils and the package share (docs/module-utils-sharing.md), through Ansible's name."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.module_utils.regen_files import LOG_TAIL_BYTES, file_sha256, read_tail, sha256_bytes
from ansible.module_utils.regen_net import is_loopback, redact_url
from ansible.module_utils.regen_secrets import SecretFileError, read_api_key, read_env_file


def test_redact_url_keeps_the_user_and_hides_the_secret() -> None:
    assert redact_url("https://alice:s3cret@pypi.example:8443/simple") == "https://alice:***@pypi.example:8443/simple"
    assert redact_url("https://tok3n@[::1]:3141/simple") == "https://***@[::1]:3141/simple"
    assert redact_url("http://127.0.0.1:30000/v1") == "http://127.0.0.1:30000/v1"
    assert redact_url("") == ""


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("localhost", True), ("10.1.2.200", False),
     ("0.0.0.0", False), ("example.org", False)],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_the_api_key_is_read_as_systemd_reads_the_env_file(tmp_path: Path) -> None:
    env = tmp_path / "serving.env"
    env.write_text("# written by the serve stage\nREGEN_SERVING_API_KEY='k-123'\nOTHER=\"x y\"\n")
    assert read_env_file(str(env)) == {"REGEN_SERVING_API_KEY": "k-123", "OTHER": "x y"}
    assert read_api_key(str(env)) == "k-123"
    assert read_api_key(None) is None  # a server without a key
    with pytest.raises(SecretFileError, match="has no MISSING= line"):
        read_api_key(str(env), "MISSING")
    with pytest.raises(SecretFileError, match="does not exist; re-run the serve stage"):
        read_api_key(str(tmp_path / "absent.env"))


def test_read_tail_reads_the_end_of_a_log_within_its_budget(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"x" * (LOG_TAIL_BYTES + 100) + "\nValueError: the end \xff\n".encode("latin-1"))
    tail = read_tail(str(log))
    assert len(tail.encode("utf-8")) <= LOG_TAIL_BYTES + 3  # one undecodable byte becomes U+FFFD
    assert tail.endswith("ValueError: the end \ufffd\n")
    assert read_tail(str(log), max_bytes=4) == "d \ufffd\n"
    assert read_tail(str(tmp_path / "none.log")) == ""


def test_sha256_of_bytes_text_and_files(tmp_path: Path) -> None:
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert sha256_bytes(b"") == sha256_bytes("") == empty
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    assert file_sha256(str(path)) == sha256_bytes("abc")
