"""The one address policy (src/regen/bind_address.py, also ansible.module_utils.regen_address).

Issue 25: the Mooncake master's wildcard refusal compared strings, so other spellings of "every
interface" passed it and bound everywhere. Each spelling here is checked against what the kernel does
with it: a socket bound to it really listens on the unspecified address.
"""

from __future__ import annotations

import socket

import pytest
from ansible.module_utils import regen_address

from regen import bind_address as B

WILDCARDS = [
    "0.0.0.0",
    "::",
    "[::]",
    "0",
    "0x0",
    "0.0",
    "000.000.000.000",
    "0:0::0",
    "::ffff:0.0.0.0",
    "",
    " ",
    "*",
    "0.0.0.0/0",
    "::/0",
    "0.0.0.0/8",
    "0x00000000",
    "[0:0:0:0:0:0:0:0]",
]
LOOPBACKS = [
    "127.0.0.1",
    "127.1",
    "0x7f000001",
    "::1",
    "[::1]",
    "127.0.0.53",
    "::ffff:127.0.0.1",
    "localhost",
]


@pytest.mark.parametrize("spelling", WILDCARDS)
def test_every_spelling_of_every_interface_is_a_wildcard(spelling: str) -> None:
    assert B.classify(spelling)["kind"] == B.WILDCARD
    assert regen_address.classify(spelling)["kind"] == B.WILDCARD  # the Ansible side judges the same
    with pytest.raises(B.BindAddressError, match="every interface"):
        B.check(
            spelling,
            service="the Mooncake master",
            variable="mooncake_master_bind_address",
            allow_variable="mooncake_master_allow_any_address",
        )
    assert (
        B.check(spelling, service="x", variable="v", allow_variable="a", allowed=True)["kind"] == B.WILDCARD
    )


@pytest.mark.parametrize("spelling", ["0", "0x0", "0.0", "000.000.000.000", "0x00000000"])
def test_the_legacy_spellings_really_bind_every_interface(spelling: str) -> None:
    # What makes them dangerous: the socket library turns them into 0.0.0.0.
    with socket.socket() as sock:
        sock.bind((spelling, 0))
        assert sock.getsockname()[0] == "0.0.0.0"


@pytest.mark.parametrize("spelling", LOOPBACKS)
def test_loopback_passes_in_any_spelling(spelling: str) -> None:
    named = spelling == "localhost"
    info = B.check(spelling, service="x", variable="v", allow_variable="a", require_ip=not named)
    assert info["kind"] == B.LOOPBACK


def test_other_addresses_names_and_garbage() -> None:
    assert B.classify("10.1.2.3")["kind"] == B.SPECIFIC
    assert B.check("10.1.2.3", service="x", variable="v", allow_variable="a")["address"] == "10.1.2.3"
    with pytest.raises(B.BindAddressError, match="beyond this host"):
        B.check("10.1.2.3", service="x", variable="v", allow_variable="a", specific_allowed=False)
    for bad in ("localhost", "example.com", "127.0.0.300", "10.0.0.0/24", "1.2.3.4.5", "::g"):
        with pytest.raises(B.BindAddressError, match="not an IPv4 or IPv6 address"):
            B.check(bad, service="x", variable="v", allow_variable="a")


def test_a_client_on_the_host_reaches_a_wildcard_through_loopback() -> None:
    assert B.local_url_host("0") == "127.0.0.1" and B.local_url_host("[::]") == "[::1]"
    assert B.local_url_host("::1") == "[::1]" and B.local_url_host("10.1.2.3") == "10.1.2.3"
