"""A small network of the test's own: a network namespace on this host, reached over a veth
pair, that holds "public" addresses (the internet, for a job), a private one (an operator's
LAN), a link-local one (where a cloud's metadata service would be), and one address in each
range that is refused to jobs because it is not the internet or carries IPv4 inside IPv6
(:data:`SIDE_DOORS`). Servers in it answer every connection with the address and port they were
reached at.

Every destination a job tries in these tests is on this host's loopback or in this namespace
(this host routes each lab address, /32 or /128, to it while the lab runs): no packet is meant
for any other address. Needs root and iproute2 (``ip netns``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

# Public addresses next to refused ranges: they must stay reachable (an entry too wide would cut them).
PUBLIC = "198.51.101.77"  # just past TEST-NET-2 (198.51.100.0/24, refused): the internet
PUBLIC6 = "2001:200::77"  # just past the IETF's 2001::/23 (refused): a registry's allocation
PUBLIC6_AFTER_6TO4 = "2003::77"  # just past 6to4 (2002::/16, refused)
NAT64_PUBLIC = "64:ff9b::198.51.101.77"  # NAT64 of a public address: the IPv4 internet, from IPv6
PRIVATE = "10.77.0.1"  # RFC 1918
LINK_LOCAL = "169.254.77.77"  # the metadata address's range (not the metadata address itself)
PORTS = (8080, 8081)
# One address in each range refused to jobs that is not private or link-local: how a job would
# step around the IPv4 rules (IPv4 inside IPv6), or a range that is not the internet.
SIDE_DOORS = {
    "::127.0.0.1": "IPv4-compatible ::/96, loopback inside (RFC 4291)",
    "::10.77.0.1": "IPv4-compatible ::/96, a private address inside",
    "::ffff:0:10.77.0.1": "IPv4-translated ::ffff:0:0:0/96 (SIIT, RFC 2765)",
    "64:ff9b::127.0.0.1": "NAT64 64:ff9b::/96 of loopback (RFC 6052)",
    "64:ff9b::10.77.0.1": "NAT64 64:ff9b::/96 of a private address",
    "64:ff9b::169.254.169.254": "NAT64 64:ff9b::/96 of the cloud metadata address",
    "64:ff9b::192.0.2.77": "NAT64 64:ff9b::/96 of a documentation address",
    "64:ff9b:1::10.77.0.1": "local-use NAT64 64:ff9b:1::/48 (RFC 8215)",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2": "Teredo 2001::/32 (RFC 4380's example)",
    "2001:2::77": "benchmarking 2001:2::/48, inside the IETF's 2001::/23",
    "2001:20::77": "ORCHIDv2 2001:20::/28, inside the IETF's 2001::/23",
    "2001:1ff:ffff::77": "the end of the IETF's protocol assignments 2001::/23",
    "2001:db8::77": "documentation 2001:db8::/32 (RFC 3849)",
    "2002:a4d:1::77": "6to4 2002::/16 of a private address (RFC 3056)",
    "3fff::77": "documentation 3fff::/20 (RFC 9637)",
    "5f00::77": "SRv6 segment identifiers 5f00::/16 (RFC 9602)",
    "100::77": "discard-only 100::/64 (RFC 6666)",
    "100:0:0:1::77": "dummy prefix 100:0:0:1::/64 (RFC 9780), reserved 100::/8",
    "1::77": "reserved by the IETF, ::/8 outside every assignment",
    "4000::77": "reserved by the IETF, outside global unicast 2000::/3",
    "fec0::77": "site-local fec0::/10 (deprecated, RFC 3879)",
    "192.0.2.77": "documentation TEST-NET-1 192.0.2.0/24 (RFC 5737)",
    "198.51.100.77": "documentation TEST-NET-2 198.51.100.0/24",
    "203.0.113.77": "documentation TEST-NET-3 203.0.113.0/24",
    "192.88.99.77": "6to4 relay anycast 192.88.99.0/24 (deprecated, RFC 7526)",
}
PUBLIC_ADDRESSES = (PUBLIC, PUBLIC6, PUBLIC6_AFTER_6TO4, NAT64_PUBLIC)
V4_ADDRESSES = (PUBLIC, PRIVATE, LINK_LOCAL, *(a for a in SIDE_DOORS if ":" not in a))
V6_ADDRESSES = tuple(a for a in (*PUBLIC_ADDRESSES, *SIDE_DOORS) if ":" in a)
_HOST_LINK_LOCAL = "fe80::1"  # this host's end of the veth: the lab's IPv6 gateway back

# Each connection is answered, then closed only once the client has closed its side (or after
# 5 s): a close with the client's bytes unread sends a RST instead of a FIN (RFC 1122 4.2.2.13),
# and a RST can overtake the answer on its way through pasta, which would read as "refused".
SERVER = r"""
import ipaddress, socket, sys, threading
def answer(conn):
    with conn:
        host, port = conn.getsockname()[:2]
        conn.sendall(f"LAB:{ipaddress.ip_address(host)}:{port}\n".encode())
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(5)
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass
def serve(sock):
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()
for port in map(int, sys.argv[1:]):
    for family, any_address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family)
        except OSError:
            continue  # no IPv6 on this host
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((any_address, port)); s.listen(64)
        threading.Thread(target=serve, args=(s,), daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
"""


def answer(address: str, port: int) -> str:
    """What the lab's server at ``address`` says when a connection reaches it."""
    return f"LAB:{ipaddress.ip_address(address)}:{port}"


def target(address: str, port: int) -> str:
    """``address:port`` as a probe takes it (``[v6]:port``)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _ipv6_enabled() -> bool:
    try:
        with open("/proc/sys/net/ipv6/conf/default/disable_ipv6") as fh:
            return fh.read().strip() == "0"
    except OSError:
        return False  # no IPv6 in this kernel


def ipv6_routed() -> bool:
    """Whether this host routes IPv6 beyond itself (a default route): pasta gives a job IPv6 then."""
    found = subprocess.run(["ip", "-6", "route", "show", "default"], capture_output=True, text=True)
    return found.returncode == 0 and bool(found.stdout.strip())


def available() -> str | None:
    """Why this host cannot make the lab (``None``: it can)."""
    if os.geteuid() != 0:
        return "the lab network needs root (ip netns)"
    if shutil.which("ip") is None:
        return "the lab network needs iproute2 (ip)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Lab:
    name: str
    host_if: str
    server: subprocess.Popen[bytes] | None = None
    addresses: list[str] = field(default_factory=list)  # those this host routes to the lab

    @classmethod
    def start(cls) -> Lab:
        tag = secrets.token_hex(3)
        lab = cls(name=f"cc-lab-{tag}", host_if=f"cch{tag}")
        inner = f"ccl{tag}"
        try:
            _ip("netns", "add", lab.name)
            _ip("link", "add", lab.host_if, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", lab.name)
            ipv6 = _ipv6_enabled()
            if ipv6:
                _ip("-6", "addr", "add", f"{_HOST_LINK_LOCAL}/64", "dev", lab.host_if, "nodad")
            _ip("link", "set", lab.host_if, "up")
            ns = ["-n", lab.name]
            _ip(*ns, "link", "set", "lo", "up")
            _ip(*ns, "link", "set", inner, "up")
            for address in (*V4_ADDRESSES, *(V6_ADDRESSES if ipv6 else ())):
                bits, dad = (32, []) if ":" not in address else (128, ["nodad"])
                _ip(*ns, "addr", "add", f"{address}/{bits}", "dev", inner, *dad)
                _ip("route", "add", f"{address}/{bits}", "dev", lab.host_if)
                lab.addresses.append(address)
            _ip(*ns, "route", "add", "default", "dev", inner)
            if ipv6:
                _ip(*ns, "-6", "route", "add", "default", "via", _HOST_LINK_LOCAL, "dev", inner)
            lab.server = subprocess.Popen(
                ["ip", "netns", "exec", lab.name, sys.executable, "-c", SERVER, *map(str, PORTS)],
                stdout=subprocess.PIPE,
            )
            assert lab.server.stdout is not None
            assert lab.server.stdout.readline().strip() == b"listening"
            lab.wait_reachable()
        except BaseException:
            lab.stop()
            raise
        return lab

    def wait_reachable(self) -> None:
        """From this host (the lab's routes are in place): every address answers."""
        deadline = time.monotonic() + 10
        for address in self.addresses:
            while True:
                try:
                    assert reach(address, PORTS[0]) == answer(address, PORTS[0])
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    def stop(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait()
        for address in self.addresses:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("route", "del", f"{address}/{128 if ':' in address else 32}", "dev", self.host_if)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.host_if)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", self.name)


def reach(address: str, port: int, timeout: float = 3.0) -> str:
    import socket

    with socket.create_connection((address, port), timeout=timeout) as sock:
        return sock.makefile().readline().strip()


# What a job runs to try a destination: one line per try, "TRY <address> <port> <result>" where
# the result is what the server said, or the error's name (never a hang: 10 s at most).
PROBE = r"""
import socket, sys, time
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    started = time.monotonic()
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as s:
            s.settimeout(10)
            result = s.makefile().readline().strip() or "EMPTY"
    except OSError as exc:
        result = type(exc).__name__
    print(f"TRY {target} {result} {time.monotonic() - started:.2f}", flush=True)
"""


def probe_command(*targets: str) -> str:
    """The shell command of a job that tries ``targets`` (``host:port``) with :data:`PROBE`."""
    import shlex

    return f"python3 -c {shlex.quote(PROBE)} " + " ".join(shlex.quote(t) for t in targets)


def tries(output: str) -> dict[str, tuple[str, float]]:
    """``{target: (result, seconds)}`` from a probe job's output."""
    found = {}
    for line in output.splitlines():
        if line.startswith("TRY "):
            _, target, result, took = line.split(" ")
            found[target] = (result, float(took))
    return found
