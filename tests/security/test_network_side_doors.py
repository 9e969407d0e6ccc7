"""Boundary: a job's network has no side door. IPv6 addresses that carry an IPv4 address
(IPv4-compatible ``::/96``, NAT64 ``64:ff9b::/96`` of a refused IPv4 address, 6to4, Teredo, ...),
documentation ranges and the IETF's reserved and special-purpose ranges are refused at once, and
the internet next to them stays open (an entry too wide would cut it).

A local machine runs on this host as `make dev` runs it; the destinations are addresses of the
test's own network namespace (tests/security/netlab.py), one in each refused range, that this
host routes to it while the lab runs.

Shown on main before these ranges were refused: the IPv4 ones (documentation ranges, 6to4 relay
anycast) answered the job (``LAB:<address>``); every IPv6 one ended "no route to host" after 3 s
(the rules refused neighbour discovery, so jobs had no IPv6 at all, the 3 s of issue 47); and
once neighbour discovery was let through, every IPv6 one answered too, among them
``[::127.0.0.1]``, ``[64:ff9b::7f00:1]`` and ``[64:ff9b::a9fe:a9fe]`` (NAT64 of the cloud
metadata address). Without the lab's routes such an address goes to the host's IPv6 gateway.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from catacloud.agent.netns import host_addresses
from catacloud.providers.machine_sandbox import network_problem
from tests.agent.fake_server import FakeAgentAPI
from tests.security import netlab
from tests.security.netlab import (
    NAT64_PUBLIC,
    PORTS,
    PUBLIC,
    PUBLIC6,
    PUBLIC6_AFTER_6TO4,
    SIDE_DOORS,
    answer,
    probe_command,
    target,
    tries,
)
from tests.security.test_network_isolation import Machines, run

pytestmark = pytest.mark.skipif(
    network_problem(Path("/tmp")) is not None, reason=f"no job network here: {network_problem(Path('/tmp'))}"
)


def refused_at_once(result: tuple[str, float]) -> bool:
    """A connection error within 2 s: the rules' reset, or no route at all. Unanswered neighbour
    discovery ("no route to host" after 3 s) or a dropped packet (the probe's 10 s) is not."""
    name, took = result
    return name in ("ConnectionRefusedError", "PermissionError", "OSError") and took < 2


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeAgentAPI]:
    group = Machines(tmp_path_factory.mktemp("side-doors") / "machines")
    try:
        yield group.start("org-a")
    finally:
        group.stop()


@pytest.fixture(scope="module")
def side_doors(lab: netlab.Lab, machine: FakeAgentAPI) -> dict[str, tuple[str, float]]:
    """What one job saw trying every side door and the internet next to them."""
    addresses = [*SIDE_DOORS, PUBLIC, PUBLIC6, PUBLIC6_AFTER_6TO4, NAT64_PUBLIC]
    finished, seen = run(machine, probe_command(*(target(a, PORTS[0]) for a in addresses)))
    assert finished["outcome"] == "succeeded", seen
    return tries(seen)


@pytest.mark.parametrize("address", list(SIDE_DOORS), ids=list(SIDE_DOORS))
def test_every_side_door_is_refused_at_once(side_doors: dict[str, tuple[str, float]], address: str) -> None:
    result = side_doors[target(address, PORTS[0])]
    assert refused_at_once(result), f"{SIDE_DOORS[address]} [{address}]: {result}"


def test_the_internet_next_to_the_refused_ranges_stays_open(side_doors: dict[str, tuple[str, float]]) -> None:
    assert side_doors[target(PUBLIC, PORTS[0])][0] == answer(PUBLIC, PORTS[0])
    if not netlab.ipv6_routed():
        pytest.skip("this host routes no IPv6, so pasta gives jobs none: nothing to reach over IPv6")
    for address in (PUBLIC6, PUBLIC6_AFTER_6TO4, NAT64_PUBLIC):  # NAT64 of a public address: IPv4's internet
        assert side_doors[target(address, PORTS[0])][0] == answer(address, PORTS[0]), address


def test_an_allowed_address_inside_a_refused_range_is_reached_on_its_port_only(
    lab: netlab.Lab, machine: FakeAgentAPI
) -> None:
    """``network.allow`` comes before every refused range, the new ones too (an operator's proxy
    on a LAN numbered from a documentation range, a private service through NAT64)."""
    allowed = ["203.0.113.77", "2001:db8::77", "64:ff9b::10.77.0.1"]
    allow = [target(a, PORTS[0]) for a in allowed]
    others = [target(a, PORTS[1]) for a in allowed] + [target("198.51.100.77", PORTS[0])]
    others += [target("::127.0.0.1", PORTS[0]), target("64:ff9b::127.0.0.1", PORTS[0])]
    finished, seen = run(machine, probe_command(*allow, *others), network={"allow": allow})
    assert finished["outcome"] == "succeeded", seen
    results = tries(seen)
    v6 = netlab.ipv6_routed()
    for address in allowed:
        if v6 or ":" not in address:
            assert results[target(address, PORTS[0])][0] == answer(address, PORTS[0]), seen
    for other in others:
        assert refused_at_once(results[other]), f"{other}: {results[other]}"


def test_over_ipv6_a_job_reaches_none_of_the_hosts_addresses_nor_its_loopback(machine: FakeAgentAPI) -> None:
    """Jobs reach the internet over IPv6 too (neighbour discovery with pasta is let through):
    the host's loopback and every IPv6 address of the host stay refused at once."""
    secret = f"host-secret-{secrets.token_hex(6)}"
    listener = socket.socket(socket.AF_INET6)
    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # and IPv4, as ::ffff:a.b.c.d
    listener.bind(("::", 0))
    listener.listen(16)
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(f"{secret}\n".encode())
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    mine = [a for a in host_addresses() if ":" in a and not a.startswith("fe80")]  # scoped: no route
    targets = [target(a, port) for a in ("::1", "::ffff:127.0.0.1", "::127.0.0.1", *mine)]
    try:
        finished, seen = run(machine, probe_command(*targets))
    finally:
        listener.close()
    assert finished["outcome"] == "succeeded", seen
    results = tries(seen)
    for one in targets:
        assert refused_at_once(results[one]), f"{one}: {results[one]}"
    assert secret not in seen
