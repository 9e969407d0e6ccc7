"""The rules a job's network namespace loads (catacloud/agent/netns.py), read as nftables reads them:
every denied range is in the sets the rules refuse, the internet next to them is not, and the
allow list and neighbour discovery come before the refusals. The network lab proves the same on
real packets (tests/security/test_network_side_doors.py)."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess

import pytest

from catacloud.agent.netns import DENIED_NETWORKS, GLOBAL_UNICAST, NAT64_PREFIX, Allow, Policy, parse_allow

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# Each named by the issue or the registries: refused, and so is every address in their ranges.
REFUSED = [
    "::127.0.0.1",  # IPv4-compatible loopback
    "::1",
    "::",
    "::ffff:127.0.0.1",
    "::ffff:0:10.0.0.1",  # IPv4-translated
    "64:ff9b::7f00:1",  # NAT64 of loopback
    "64:ff9b::10.1.2.3",
    "64:ff9b::169.254.169.254",  # NAT64 of the cloud metadata address
    "64:ff9b::100.64.0.1",
    "64:ff9b::192.168.1.1",
    "64:ff9b::224.0.0.1",
    "64:ff9b::255.255.255.255",
    "64:ff9b::0.0.0.0",
    "64:ff9b:1::a00:1",  # local-use NAT64
    "64:ff9b::1:0:0",  # inside 64:ff9b::/64 but beyond its /96: reserved
    "100::1",
    "100:0:0:1::1",
    "2001::1",  # Teredo
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",
    "2001:1::1",
    "2001:2::1",
    "2001:20::1",
    "2001:1ff:ffff:ffff:ffff:ffff:ffff:ffff",  # the last address of 2001::/23
    "2001:db8::1",
    "2002:7f00:1::1",  # 6to4 of loopback
    "2002:a9fe:a9fe::1",
    "3fff::1",
    "3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff",
    "5f00::1",
    "1fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",  # the last address before global unicast
    "4000::",  # the first after it
    "fc00::1",
    "fd00::2",
    "fe80::1",
    "fec0::1",
    "ff02::1",
    "0.0.0.0",
    "127.0.0.1",
    "169.254.169.254",
    "192.0.0.9",
    "192.0.2.1",
    "192.88.99.1",
    "198.18.0.1",
    "198.51.100.1",
    "203.0.113.255",
    "240.0.0.1",
    "255.255.255.255",
]
# The internet right next to refused ranges: an entry too wide would cut it.
OPEN = [
    "8.8.8.8",
    "1.1.1.1",
    "192.0.1.255",
    "192.0.3.0",
    "192.88.98.255",
    "192.88.100.0",
    "198.51.99.255",
    "198.51.101.0",
    "203.0.112.255",
    "203.0.114.0",
    "223.255.255.255",
    "192.31.196.1",  # AS112: a public DNS sink
    "2000::1",  # the first of global unicast
    "2001:200::1",  # the first registry allocation after the IETF's 2001::/23
    "2001:4860:4860::8888",
    "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff",
    "2001:db9::1",
    "2003::1",  # after 6to4
    "2606:4700:4700::1111",
    "2620:4f:8000::1",  # AS112 direct delegation
    "3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
    "3fff:1000::1",
    "64:ff9b::8.8.8.8",  # NAT64 of a public address: IPv4's internet from an IPv6-only host
    "64:ff9b::1.1.1.1",
    "64:ff9b::223.255.255.255",
]


def refused_sets(ruleset: str) -> list[tuple[Address, Address]]:
    """Every interval in the ruleset's ``denied4`` and ``denied6`` sets, as nftables reads them."""
    spans = []
    for name in ("denied4", "denied6"):
        found = re.search(rf"set {name} {{[^}}]*elements = {{ ([^}}]*) }}", ruleset)
        assert found, f"no set {name} in the ruleset"
        for element in found.group(1).split(", "):
            if "-" in element:
                low, high = element.split("-")
                spans.append((ipaddress.ip_address(low), ipaddress.ip_address(high)))
            else:
                network = ipaddress.ip_network(element)
                spans.append((network.network_address, network.broadcast_address))
    return spans


def covered(spans: list[tuple[Address, Address]], address: Address) -> bool:
    return any(low.version == address.version and low <= address <= high for low, high in spans)  # type: ignore[operator]


def test_every_denied_network_whole_is_in_the_rules_the_namespace_loads() -> None:
    spans = refused_sets(Policy().ruleset())
    for entry in DENIED_NETWORKS:
        network = ipaddress.ip_network(entry)
        assert covered(spans, network.network_address) and covered(spans, network.broadcast_address), entry


@pytest.mark.parametrize("address", REFUSED)
def test_each_side_door_and_special_range_is_refused(address: str) -> None:
    assert covered(refused_sets(Policy().ruleset()), ipaddress.ip_address(address))


@pytest.mark.parametrize("address", OPEN)
def test_the_internet_next_to_them_is_not(address: str) -> None:
    assert not covered(refused_sets(Policy().ruleset()), ipaddress.ip_address(address))


def test_ipv6_outside_global_unicast_is_refused_but_nat64_of_public_addresses() -> None:
    spans = refused_sets(Policy().ruleset())
    nat64 = ipaddress.IPv6Network(NAT64_PREFIX)
    for reserved in ipaddress.IPv6Network("::/0").address_exclude(ipaddress.IPv6Network(GLOBAL_UNICAST)):
        for address in (reserved.network_address, reserved.broadcast_address):
            assert covered(spans, address), address
    # Of 64:ff9b::/96, exactly the images of the refused IPv4 networks are refused.
    for network in (ipaddress.ip_network(n) for n in DENIED_NETWORKS if "." in n):
        first = ipaddress.IPv6Address(int(nat64.network_address) + int(network.network_address))
        last = ipaddress.IPv6Address(int(nat64.network_address) + int(network.broadcast_address))
        assert covered(spans, first) and covered(spans, last), network
        for outside in (int(network.network_address) - 1, int(network.broadcast_address) + 1):
            v4 = ipaddress.IPv4Address(outside % 2**32)
            image = ipaddress.IPv6Address(int(nat64.network_address) + int(v4))
            assert covered(spans, image) == covered(spans, v4), (network, v4)


def test_every_address_of_the_host_is_refused_and_through_nat64_too() -> None:
    spans = refused_sets(Policy(host_addresses=("8.8.4.4", "2001:4860::5", "fe80::1%eth0")).ruleset())
    for address in ("8.8.4.4", "2001:4860::5", "64:ff9b::8.8.4.4"):
        assert covered(spans, ipaddress.ip_address(address)), address
    assert not covered(spans, ipaddress.ip_address("8.8.8.8"))


def test_allowed_destinations_and_neighbour_discovery_come_before_the_refusals() -> None:
    allow = parse_allow(["203.0.113.5:3128", "[64:ff9b::10.0.0.5]:80", "2001:db8::/64"])
    ruleset = Policy(allow=tuple(allow)).ruleset()
    first_refusal = ruleset.index("daddr @denied")
    for rule in (
        "ip daddr 203.0.113.5/32 meta l4proto { tcp, udp } th dport 3128 accept",
        "ip6 daddr 64:ff9b::a00:5/128 meta l4proto { tcp, udp } th dport 80 accept",
        "ip6 daddr 2001:db8::/64 accept",
        "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } ip6 hoplimit 255 accept",
    ):
        assert 0 <= ruleset.index(rule) < first_refusal, rule


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("unshare"),
    reason="loading rules needs root, nft and unshare",
)
def test_nftables_loads_the_rules_as_written() -> None:
    allow = parse_allow(["203.0.113.5:3128", "[64:ff9b::10.0.0.5]:80", "127.0.0.1:8765"])
    ruleset = Policy(allow=tuple(allow), host_addresses=("192.0.2.2", "fd00::2", "2001:4860::5")).ruleset()
    loaded = subprocess.run(
        ["unshare", "--net", "sh", "-c", "nft -f - && nft list set inet catacloud_job denied6"],
        input=ruleset,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert "2001:4860::5" in loaded.stdout and "64:ff9b::a00:0/104" in loaded.stdout


@pytest.mark.parametrize(
    ("address", "port", "reached"),
    [
        ("127.0.0.1", 5000, True),  # the loopback port an entry names: pasta forwards it
        ("::ffff:127.0.0.1", 5000, True),
        ("127.0.0.1", 2375, False),  # any other: the job's own loopback answers there
        ("0.0.0.0", 80, False),
        ("::1", 80, False),
        ("10.1.2.3", 80, False),  # the host's own address: pasta gives it to the job, itself
        ("10.9.9.9", 80, True),  # the rest of the allowed networks
        ("8.8.8.8", 443, True),
    ],
)
def test_what_the_agent_fetches_for_a_job_reaches_only_what_the_job_would(
    address: str, port: int, reached: bool
) -> None:
    """Policy.reaches, for the registry mirror's connections (catacloud/agent/registry_proxy.py):
    an allow list as wide as the internet still does not open the host's loopback or addresses,
    which the job's own namespace answers itself."""
    import ipaddress

    policy = Policy(
        allow=(Allow.parse("0.0.0.0/0"), Allow.parse("::/0"), Allow.parse("127.0.0.1:5000")),
        host_addresses=("10.1.2.3",),
    )
    assert policy.reaches(ipaddress.ip_address(address), port) is reached
    assert not Policy().reaches(ipaddress.ip_address("169.254.169.254"), 80)  # metadata, unallowed


# -- the helper the agent keeps running (each job network a child it forks) ---------------------


def test_the_kept_helper_answers_each_request_with_its_childs_own_error() -> None:
    from catacloud.agent.netns import KeptHelper

    kept = KeptHelper()
    try:
        # Arguments the helper does not know: the child's usage, on the request's own stderr.
        taken, why = kept.run(["bogus"], b"")
        assert taken and why == "netns_helper.py serve SOCKET_FD", why
        first = kept.pid
        # A network for a sandbox that is not there: the child's error, and the same helper serves on.
        taken, why = kept.run(["attach", "999999999", "-", "-", "/nonexistent/pasta.pid", "/bin/false"], b"")
        assert taken and why is not None and "No such file or directory" in why, why
        assert kept.pid == first is not None
    finally:
        kept.close()
    assert kept.pid is None


def test_the_kept_helper_ends_with_its_agent_and_a_dead_one_is_replaced() -> None:
    import psutil

    from catacloud.agent.netns import KeptHelper

    kept = KeptHelper()
    try:
        assert kept.run(["bogus"], b"")[0]
        helper = psutil.Process(kept.pid)
        assert kept._sock is not None
        kept._sock.close()  # what the kernel does to the agent's end when the agent dies
        assert helper.wait(timeout=10) == 0, "the helper outlived its agent's socket"
        kept._sock = None
        # The next request starts a new helper (the old one is gone).
        taken, why = kept.run(["bogus"], b"")
        assert taken and why is not None and kept.pid not in (None, helper.pid)
        second = kept.pid
        assert second is not None and kept._proc is not None
        os.kill(second, 9)  # a helper killed between requests: the next one starts again
        kept._proc.wait(timeout=10)
        assert kept.run(["bogus"], b"")[0] and kept.pid not in (None, second)
    finally:
        kept.close()
