"""A job's network: a namespace of its own that reaches the internet and nothing else.

Every sandboxed job starts in a new network namespace (bubblewrap's ``--unshare-net``),
held before its command runs (at its gate: ``sandbox.StartGate``) until the agent has set the
namespace up:

1. **Rules first.** A small helper (netns_helper.py: a child of the helper the agent keeps
   running, or the script run with ``python -I -S``; as the job's uid, which owns the job's user
   namespace) joins the job's user and network namespaces
   and loads an nftables table through ``libnftables``: traffic to the host's loopback, private
   ranges (RFC 1918, CGNAT, ULA), link-local (``169.254.0.0/16``: the cloud metadata address),
   multicast, documentation and reserved ranges (all IPv6 outside ``2000::/3``), every IPv6 range
   that carries IPv4 (IPv4-compatible and -mapped, 6to4, Teredo, and NAT64 to any IPv4 address
   refused here) and every address of the host is refused at once (a TCP reset or an ICMP
   "administratively prohibited": a connection error, never a hang), unless the machine type's
   ``network.allow`` names the destination (:data:`DENIED_NETWORKS` says which ranges and why).
   The job's own processes hold no capability in that namespace, so they cannot change the rules.
2. **Then the internet.** ``pasta`` (Debian's ``passt`` package: user-mode networking made for
   rootless containers, the one Podman uses) joins the namespace from outside and gives it a
   tap interface with the host's addresses and routes; it relays the job's TCP, UDP and ICMP
   through ordinary sockets of its own (opened as the job's uid). It maps nothing of the host's
   loopback (``--no-map-gw``, no port forwarding) except the loopback ports an allow entry
   names (``127.0.0.1:PORT``: forwarded with ``-T PORT``). DNS goes to :data:`DNS_ADDRESS`,
   which pasta forwards to the host's resolver; the job's ``/etc/resolv.conf`` names it.
3. Then the agent unblocks the sandbox and the command starts.

Abstract unix sockets and ``/proc/net`` belong to a network namespace, so they are the job's
own. The job still talks to its agent through its unix socket (a file, bound into the sandbox).
When ``pasta`` or ``libnftables`` is missing (or this host refuses them), jobs get a namespace
with a loopback and nothing else: no network rather than the host's (:func:`probe_egress` says
why; the machine reports it at enrollment).

The helper is :mod:`catacloud.agent.netns_helper`, a script of its own that imports as little as
it can. The agent keeps one running (:class:`KeptHelper`) and each job network is a child forked
from it: no Python starts per job network.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import ipaddress
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from catacloud.agent import netns_helper

# Where a job's DNS queries go: pasta forwards them to the host's resolver (its replies come back
# from this address, so the job's resolv.conf names it). Link-local: never a real destination.
DNS_ADDRESS = "169.254.1.53"
# Refused to every job unless its machine type allows the destination: every range that is not the
# internet (IANA's IPv4 and IPv6 Special-Purpose Address Registries, RFC 6890), and every IPv6 range
# that embeds an IPv4 address or tunnels to one (a side door to the IPv4 ranges refused here).
DENIED_NETWORKS = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8",  # private (RFC 1918)
    "100.64.0.0/10",  # carrier-grade NAT (RFC 6598)
    "127.0.0.0/8",  # loopback (the host's, through a relay)
    "169.254.0.0/16",  # link-local: cloud metadata (169.254.169.254), the VPC resolver
    "172.16.0.0/12",  # private (RFC 1918)
    "192.0.0.0/24",  # IETF protocol assignments (DS-Lite, NAT64 discovery, PCP and TURN anycast)
    "192.0.2.0/24",  # documentation, TEST-NET-1 (RFC 5737): never the internet, at times a LAN
    "192.88.99.0/24",  # 6to4 and 6a44 relay anycast (deprecated, RFC 7526): tunnel ends
    "192.168.0.0/16",  # private (RFC 1918)
    "198.18.0.0/15",  # benchmarking (RFC 2544)
    "198.51.100.0/24",  # documentation, TEST-NET-2 (RFC 5737)
    "203.0.113.0/24",  # documentation, TEST-NET-3 (RFC 5737)
    "224.0.0.0/3",  # multicast, reserved (240.0.0.0/4), limited broadcast (255.255.255.255)
    "::/96",  # unspecified, loopback (::1), IPv4-compatible ::a.b.c.d (RFC 4291 2.5.5.1)
    "::ffff:0:0/96",  # IPv4-mapped ::ffff:a.b.c.d: a job reaches IPv4 through IPv4
    "::ffff:0:0:0/96",  # IPv4-translated ::ffff:0:a.b.c.d (SIIT, RFC 2765)
    "64:ff9b:1::/48",  # local-use NAT64 (RFC 8215): a site's own translator, to its own IPv4
    "100::/64",  # discard-only (RFC 6666)
    "2001::/23",  # IETF protocol assignments (RFC 2928): Teredo 2001::/32 (RFC 4380), see below
    "2001:db8::/32",  # documentation (RFC 3849)
    "2002::/16",  # 6to4 (RFC 3056): 2002:a.b.c.d::/48 tunnels to the IPv4 address a.b.c.d
    "3fff::/20",  # documentation (RFC 9637)
    "5f00::/16",  # SRv6 segment identifiers (RFC 9602): a segment-routing domain's own
    "fc00::/7",  # unique local (RFC 4193)
    "fe80::/10",  # link-local
    "fec0::/10",  # site-local (deprecated, RFC 3879): a site's own where still used
    "ff00::/8",  # multicast
)
# IPv6's internet is IANA's global unicast space (RFC 4291 2.4; IANA's IPv6 Address Space registry):
# everything outside it is reserved by the IETF and refused too (it holds the ranges above that lie
# outside 2000::/3, and 100:0:0:1::/64, RFC 9780, and whatever is assigned there next) ...
GLOBAL_UNICAST = "2000::/3"
# ... except the NAT64 well-known prefix (RFC 6052): 64:ff9b::a.b.c.d is the IPv4 address a.b.c.d
# through the network's NAT64, the only way to IPv4 from an IPv6-only host (DNS64 answers it for
# every IPv4-only name). Of it only the images of what is refused over IPv4 are refused
# (64:ff9b::10.0.0.0/104, 64:ff9b::127.0.0.0/104, ...): NAT64 gives a job no address that IPv4
# would not (RFC 6052 3.1 tells translators to drop such packets; not all do: AWS's NAT gateway
# reaches a VPC's private addresses).
NAT64_PREFIX = "64:ff9b::/96"
#
# Considered beside those, and why each is in or out:
# - Out: 2001::/16 or any entry wider than the IETF's own blocks: 2001:200::/23 onwards (and
#   2003::/16 after 6to4) are regional registries' allocations, the real internet.
# - In with the rest of 2001::/23, although the registry calls them globally reachable: PCP,
#   TURN and DNS-SD SRP anycast (2001:1::1-3: the network's own middleboxes, not a job's
#   business), AMT relays (2001:3::/32: multicast tunnelled in UDP), AS112-v6 (2001:4:112::/48: a
#   DNS sink), ORCHIDv2 (2001:20::/28) and drone DETs (2001:30::/28): identifiers, not
#   destinations. The IETF keeps assigning there, so the block is refused whole: a new entry is
#   refused before anyone looks.
# - Out: AS112 (192.31.196.0/24, 192.175.48.0/24, 2620:4f:8000::/48) and AMT relay anycast
#   (192.52.193.0/24): globally reachable public services, the internet.
# - Out: ISATAP (RFC 5214): the IPv4 address sits in the interface identifier (::5efe:a.b.c.d,
#   ::200:5efe:a.b.c.d) under any /64, not in a prefix: the /64 in front routes like any other
#   address, to the site that owns it, and only that site's ISATAP router reads the IPv4 address.
#   Refusing it would mean matching the low 64 bits of every internet address. (A site that runs
#   ISATAP on the host's own prefix would be reached that way; current systems have it off.)
# - Out: 6rd (RFC 5969), NAT64 network-specific prefixes (RFC 6052 2.2): prefixes an operator
#   chooses inside ordinary global space, unknowable from the address (on such a network a job
#   reaches what that translator reaches).
# - In already: 6over4 (RFC 2529: multicast and link-local); 240.0.0.0/4 and 255.255.255.255
#   (in 224.0.0.0/3); DS-Lite, PCP and TURN anycast in 192.0.0.0/24.

# A job network is set up in well under a second (p99 about 0.1 s); the limit only ends a setup
# that is stuck, and leaves room for a host under heavy load (10 s was reached at load 80 on 2 cores).
SETUP_TIMEOUT_SECONDS = 30.0

log = logging.getLogger("catacloud.agent")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Allow:
    """One ``network.allow`` entry: an address or network, and a port (``None``: every port).

    Written ``10.0.0.5:3128``, ``10.0.0.0/24``, ``10.0.0.5``, ``[fd00::5]:3128``, ``fd00::/64``;
    the host's loopback only with a port (``127.0.0.1:8765``, ``localhost:8765``, ``[::1]:8765``).
    Names other than ``localhost`` are refused: a rule holds for an address, not for whatever a
    name resolves to tomorrow."""

    network: Network
    port: int | None = None

    @classmethod
    def parse(cls, text: object) -> Allow:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{text!r}: expected an address, ADDRESS:PORT or a network (CIDR)")
        raw = text.strip()
        host, port = raw, None
        if raw.startswith("["):  # [v6]:port
            end = raw.find("]")
            if end < 0 or not raw[end + 1 :].startswith(":"):
                raise ValueError(f"{raw!r}: write an IPv6 address with a port as [ADDRESS]:PORT")
            host, port = raw[1:end], _port(raw, raw[end + 2 :])
        elif raw.count(":") == 1:  # v4:port or name:port
            host, text_port = raw.split(":")
            port = _port(raw, text_port)
        if host.lower() == "localhost":
            host = "127.0.0.1"
        try:
            network = ipaddress.ip_network(host, strict=True)
        except ValueError as exc:
            if any(c.isalpha() for c in host) and "/" not in host and ":" not in host:
                raise ValueError(f"{raw!r}: name an address or a network, not a host name") from None
            raise ValueError(f"{raw!r}: {exc}") from None
        if network.is_loopback and port is None:
            raise ValueError(f"{raw!r}: the host's loopback is allowed one port at a time (ADDRESS:PORT)")
        if network.is_loopback and network.num_addresses != 1:
            raise ValueError(f"{raw!r}: name one loopback address with a port, not a network")
        return cls(network, port)

    @property
    def loopback(self) -> bool:
        return self.network.is_loopback

    def __str__(self) -> str:
        address = str(self.network.network_address) if self.network.num_addresses == 1 else str(self.network)
        if self.port is None:
            return address
        return f"[{address}]:{self.port}" if self.network.version == 6 else f"{address}:{self.port}"


def _port(raw: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{raw!r}: the port must be a number from 1 to 65535")
    return int(text)


def parse_allow(entries: object) -> list[Allow]:
    """The allow list of a machine type's ``network``; ``ValueError`` names the first bad entry."""
    if entries is None:
        return []
    if not isinstance(entries, list | tuple):
        raise ValueError("network.allow must be a list of addresses (ADDRESS, ADDRESS:PORT or a network)")
    allows = [Allow.parse(entry) for entry in entries]
    return sorted(set(allows), key=str)


def normalize_network(value: object) -> dict[str, Any]:
    """A machine type's ``network`` as stored: ``{"allow": [...]}`` with every entry in one spelling."""
    if value in (None, "", {}):
        return {}
    if not isinstance(value, dict):
        raise ValueError('network must be an object, for example {"allow": ["10.0.0.5:3128"]}')
    unknown = sorted(set(value) - {"allow"})
    if unknown:
        raise ValueError(f"network: unknown key {unknown[0]!r} (known: allow)")
    allows = parse_allow(value.get("allow"))
    return {"allow": [str(a) for a in allows]} if allows else {}


# -- the ruleset ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What one job may reach besides the internet."""

    allow: tuple[Allow, ...] = ()
    host_addresses: tuple[str, ...] = ()  # every address of this host: refused like loopback

    @property
    def forwarded_ports(self) -> list[int]:
        """The host loopback ports forwarded into the job's namespace."""
        return sorted({a.port for a in self.allow if a.loopback and a.port is not None})

    def reaches(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> bool:
        """Whether a job under this policy reaches ``address:port``, as :meth:`ruleset` decides:
        for what the agent fetches on a job's behalf (catacloud/agent/registry_proxy.py)."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.is_loopback or address.is_unspecified:
            # The job's own namespace answers these: it reaches the host's loopback only at a port
            # an entry names exactly (pasta's forward), whatever wider network another names.
            return any(a.loopback and a.port == port and address in a.network for a in self.allow)
        if any(address == ipaddress.ip_address(h.split("%")[0]) for h in self.host_addresses):
            return False  # pasta gives the job the host's addresses: there it only meets itself
        if any(address in a.network and a.port in (None, port) for a in self.allow):
            return True
        return not refused_everywhere(str(address))

    def ruleset(self) -> str:
        """The job namespace's nftables table (``nft -f`` syntax)."""
        lines = [
            "table inet catacloud_job {",
            *_denied_sets(tuple(self.host_addresses)),
            "  chain output {",
            "    type filter hook output priority filter; policy accept;",
            '    oifname "lo" accept',  # the namespace's own loopback (and the forwarded ports)
            f"    ip daddr {DNS_ADDRESS} meta l4proto {{ tcp, udp }} th dport 53 accept",
            # Neighbour discovery with pasta, IPv6's ARP (to a multicast or link-local address,
            # refused below): without it no IPv6 packet leaves (the gateway never resolves, and a
            # job waits 3 s for "no route to host"). Hop limit 255: never forwarded (RFC 4861 7.1).
            "    icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } ip6 hoplimit 255 accept",
        ]
        for allow in self.allow:
            if allow.loopback:
                continue  # reached through pasta's forward on the namespace's own loopback
            family = "ip" if allow.network.version == 4 else "ip6"
            port = f" meta l4proto {{ tcp, udp }} th dport {allow.port}" if allow.port else ""
            lines.append(f"    {family} daddr {allow.network}{port} accept")
        for family, name in (("ip", "denied4"), ("ip6", "denied6")):
            lines.append(f"    {family} daddr @{name} meta l4proto tcp reject with tcp reset")
            lines.append(f"    {family} daddr @{name} reject with icmpx type admin-prohibited")
        lines += ["  }", "}", ""]
        return "\n".join(lines)


def denied_networks(
    host_addresses: Iterable[str] = (),
) -> tuple[list[ipaddress.IPv4Network], list[ipaddress.IPv6Network]]:
    """What a job's namespace refuses, IPv4 and IPv6, each merged into the fewest networks:
    :data:`DENIED_NETWORKS`, IPv6 outside :data:`GLOBAL_UNICAST` (but for :data:`NAT64_PREFIX`),
    the NAT64 images of every refused IPv4 network, and every address of this host."""
    v4 = [ipaddress.IPv4Network(n) for n in DENIED_NETWORKS if ipaddress.ip_network(n).version == 4]
    v6 = [ipaddress.IPv6Network(n) for n in DENIED_NETWORKS if ipaddress.ip_network(n).version == 6]
    for address in host_addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.version == 4:
            v4.append(ipaddress.IPv4Network(ip))
        else:
            v6.append(ipaddress.IPv6Network(ip))
    nat64 = ipaddress.IPv6Network(NAT64_PREFIX)
    for reserved in ipaddress.IPv6Network("::/0").address_exclude(ipaddress.IPv6Network(GLOBAL_UNICAST)):
        v6 += reserved.address_exclude(nat64) if nat64.subnet_of(reserved) else [reserved]
    base = int(nat64.network_address)
    v6 += [ipaddress.IPv6Network((base + int(n.network_address), 96 + n.prefixlen)) for n in v4]
    return list(ipaddress.collapse_addresses(v4)), list(ipaddress.collapse_addresses(v6))


@functools.lru_cache(maxsize=4)
def _denied_sets(host_addresses: tuple[str, ...]) -> tuple[str, str]:
    """The two sets' lines, made once for a host's addresses (about 10 ms: not at every job start)."""
    v4, v6 = denied_networks(host_addresses)
    return _set("denied4", "ipv4_addr", _intervals(v4)), _set("denied6", "ipv6_addr", _intervals(v6))


def refused_everywhere(address: str) -> bool:
    """Whether every job's namespace refuses ``address`` (this host's own addresses aside): for
    checks elsewhere that must agree with the jobs' rules (the webhook well's)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    v4, v6 = _denied_without_host()
    return any(ip in network for network in (v4 if ip.version == 4 else v6))


@functools.lru_cache(maxsize=1)
def _denied_without_host() -> tuple[list[ipaddress.IPv4Network], list[ipaddress.IPv6Network]]:
    return denied_networks()


def _intervals(networks: Sequence[Network]) -> list[str]:
    """Sorted, merged ``networks`` as nftables set elements: ``a/n``, or ``first-last`` where
    adjacent networks make a range that no single prefix spells."""
    spans: list[list[Any]] = []
    for network in sorted(networks, key=lambda n: int(n.network_address)):
        first, last = network.network_address, network.broadcast_address
        if spans and int(first) <= int(spans[-1][1]) + 1:
            spans[-1][1] = max(spans[-1][1], last)
        else:
            spans.append([first, last])
    elements = []
    for first, last in spans:
        made = list(ipaddress.summarize_address_range(first, last))
        elements.append(str(made[0]) if len(made) == 1 else f"{first}-{last}")
    return elements


def _set(name: str, kind: str, elements: list[str]) -> str:
    listed = ", ".join(elements)
    return f"  set {name} {{ type {kind}; flags interval; auto-merge; elements = {{ {listed} }} }}"


def host_addresses() -> tuple[str, ...]:
    """Every address of this host's interfaces (what a relay from the host would reach)."""
    import socket

    try:
        import psutil
    except ImportError:  # the helper's bare interpreter never asks
        return ()
    found = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                found.add(address.address.split("%")[0])
    return tuple(sorted(found))


def resolv_conf() -> bytes:
    """The job's ``/etc/resolv.conf``."""
    return f"# the job's resolver: pasta forwards it to the host's\nnameserver {DNS_ADDRESS}\n".encode()


# -- setting a job's namespace up --------------------------------------------------------------


@dataclass
class Egress:
    """How this machine gives jobs the internet: ``pasta`` (with the rules), or ``none``."""

    mode: str  # "pasta" | "none"
    pasta: str = ""
    detail: str = ""
    host_addresses: tuple[str, ...] = field(default_factory=tuple)
    kept: KeptHelper = field(default_factory=lambda: KeptHelper(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode == "pasta":
            _denied_sets(tuple(self.host_addresses))  # made at the agent's start, not at a job's

    def describe(self) -> dict[str, Any]:
        return {"network": self.mode, "network_detail": self.detail}

    def policy(self, allow: Iterable[Allow]) -> Policy:
        return Policy(allow=tuple(allow), host_addresses=self.host_addresses)

    def pasta_argv(self, policy: Policy) -> list[str]:
        """pasta and its options for a job network (its namespaces are added by the helper)."""
        forwards = ",".join(str(p) for p in policy.forwarded_ports) or "none"
        argv = [self.pasta, "--config-net", "--quiet", "--no-map-gw", "--tcp-ports", "none"]
        argv += ["--udp-ports", "none", "--tcp-ns", forwards, "--udp-ns", "none"]
        return [*argv, "--dns-forward", DNS_ADDRESS]

    def _helper(self, argv: list[str], policy: Policy, pass_fds: Sequence[int] = ()) -> str | None:
        """Run the helper (:mod:`catacloud.agent.netns_helper`): a child of the one kept running,
        else the script; ``None`` when it (and so pasta) is ready, else why not."""
        argv = [*argv, *self.pasta_argv(policy)]
        rules = policy.ruleset().encode()
        taken, why = self.kept.run(argv, rules, pass_fds)
        if taken:
            return why
        try:
            helper = subprocess.run(
                [sys.executable, "-I", "-S", netns_helper.__file__, *argv],
                input=rules,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=SETUP_TIMEOUT_SECONDS,
                close_fds=True,
                pass_fds=pass_fds,
                env=_helper_env(),
            )
        except subprocess.TimeoutExpired:
            return TOO_LONG
        if helper.returncode != 0:
            return _last_line(helper.stderr)
        return None

    def prepare(
        self, folder: str, *, uid: int | None, gid: int | None, policy: Policy
    ) -> tuple[int, int] | str:
        """A job network made before its job: new user and network namespaces owned by ``uid``
        (the next job's), its rules loaded, its pasta running (pid in ``folder``/pasta.pid).
        Returns file descriptors of the user and network namespaces, or why not.

        The helper's child creates the namespaces (mapping only its own uid and gid into them),
        loads the rules there and waits; this agent opens its namespaces, then lets it go: the
        descriptors (and pasta) hold them until the job's sandbox joins them (``nsenter``)."""
        if self.mode != "pasta":
            return "no job network on this machine"
        keep, let_go = os.pipe()
        try:
            why = self._helper(["prepare", *_id_args(uid, gid), folder, str(keep)], policy, pass_fds=(keep,))
            os.close(keep)
            keep = -1
            if why is not None:
                return why
            opened: list[int] = []
            try:
                with open(os.path.join(folder, "holder.pid")) as fh:
                    holder = int(fh.read().strip())
                for kind in ("user", "net"):
                    opened.append(os.open(f"/proc/{holder}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC))
            except (OSError, ValueError) as exc:
                for fd in opened:
                    os.close(fd)
                stop_pasta(os.path.join(folder, "pasta.pid"))
                return f"cannot open the prepared namespaces: {exc}"
            return opened[0], opened[1]
        finally:
            for fd in (keep, let_go):
                if fd >= 0:
                    os.close(fd)

    def attach(
        self, pid_file: str, *, pid: int, uid: int | None, gid: int | None, policy: Policy
    ) -> str | None:
        """Rules, then pasta, for the sandbox whose first process is ``pid``; ``None`` when the
        job's namespace is ready (pasta's pid is then in ``pid_file``), else what went wrong (the
        job must not start then).

        The helper starts as this agent (a job uid may not reach the agent's Python), takes the
        job's uid (which owns the job's user namespace, the one its network namespace belongs
        to), loads the rules in a child that joins both, then becomes pasta."""
        if self.mode != "pasta":
            return None  # a namespace with a loopback only
        return self._helper(["attach", str(pid), *_id_args(uid, gid), pid_file], policy)


def stop_pasta(pid_file: str) -> None:
    """End the pasta of one job (it outlives the job's processes: it holds their namespace)."""
    import signal

    try:
        with open(pid_file) as fh:
            pid = int(fh.read().strip())
    except (OSError, ValueError):
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = fh.read().split(b"\0")
        if os.fsencode(pid_file) not in args:  # pasta was told this file: else the number was reused
            return
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return


def sweep(folder: str) -> None:
    """End the pastas an earlier agent left in ``folder`` (networks made ahead of a job that never
    came: it was killed before it could end them) and remove their folders."""
    import glob

    for path in glob.glob(os.path.join(glob.escape(folder), ".net-*")):
        stop_pasta(os.path.join(path, "pasta.pid"))
        shutil.rmtree(path, ignore_errors=True)


TOO_LONG = "the job's network took too long to set up"


def _helper_env() -> dict[str, str]:
    return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", netns_helper.LIBRARY_ENV: _library() or ""}


class KeptHelper:
    """The job network's helper kept running (``netns_helper.py serve``, started at the first job
    network): each network is a child it forks, which does what the script does, so no Python
    starts per job network (some 12 ms of CPU and of wall time each). One request at a time, over
    a socket pair only this agent holds; the helper ends when the agent closes its end (or dies:
    the kernel closes it). When it cannot be started or reached, nothing of a request ran and the
    caller runs the script instead; a request that gets no answer (the helper died, or the network
    took longer than :data:`SETUP_TIMEOUT_SECONDS`: its child is killed) fails, and the next one
    starts a new helper."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None

    @property
    def pid(self) -> int | None:
        """The helper's process (``None``: none running)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def run(self, argv: list[str], rules: bytes, pass_fds: Sequence[int] = ()) -> tuple[bool, str | None]:
        """(taken, why): ``taken`` False when the helper could not take the request (nothing of it
        ran); else ``why`` is ``None`` when the network is ready, or why not."""
        with self._lock:
            sock = self._started()
            if sock is None:
                return False, None
            read, write = os.pipe()  # the request's stderr
            try:
                try:
                    request = rules + b"\0\0" + b"\0".join(arg.encode() for arg in argv)
                    socket.send_fds(sock, [request], [write, *pass_fds])
                except OSError:
                    self._stop()
                    return False, None
                finally:
                    os.close(write)
                return True, self._answer(sock, read)
            finally:
                os.close(read)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _started(self) -> socket.socket | None:
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", netns_helper.__file__, "serve", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=(theirs.fileno(),),
                env=_helper_env(),
            )
        except OSError as exc:
            log.warning("could not start the job network's helper (each network runs it anew): %s", exc)
            ours.close()
            return None
        finally:
            theirs.close()
        self._sock = ours
        return ours

    def _answer(self, sock: socket.socket, stderr: int) -> str | None:
        deadline = time.monotonic() + SETUP_TIMEOUT_SECONDS
        child = None
        try:
            child = int(_message(sock, b"pid ", deadline))
            code = int(_message(sock, b"exit ", deadline))
        except (OSError, ValueError) as exc:  # TimeoutError is an OSError
            if child is not None:
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
            self._stop()
            return TOO_LONG if isinstance(exc, TimeoutError) else "the job network's helper ended"
        if code == 0:
            return None
        # Its writers are its child and what that started (they write before they exit): a moment.
        return _last_line(_read_all(stderr, min(deadline, time.monotonic() + 2.0)))

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
            self._proc = None


def _message(sock: socket.socket, prefix: bytes, deadline: float) -> bytes:
    """The kept helper's next answer, which starts with ``prefix``: what follows it."""
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    data = sock.recv(64)
    if not data.startswith(prefix):
        raise ValueError(f"the helper answered {data!r}")  # b"": it ended
    return data[len(prefix) :]


def _read_all(fd: int, deadline: float, limit: int = 1 << 16) -> bytes:
    """What a request's child wrote to its stderr, until every writer closed it (or ``deadline``)."""
    got = b""
    while len(got) < limit:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        got += chunk
    return got


def _last_line(data: bytes) -> str:
    lines = [line for line in data.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def find_pasta() -> str | None:
    """The ``pasta`` binary (Debian's ``passt`` package), or the one ``CATACLOUD_PASTA`` names."""
    chosen = os.environ.get("CATACLOUD_PASTA")
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    return shutil.which("pasta", path="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")


INSTALL_HINT = "install Debian's passt and nftables packages (apt install passt nftables)"


def egress_problem() -> str | None:
    """Why this host cannot give jobs the internet through pasta (``None``: it can, as far as
    the binaries go; :func:`catacloud.agent.sandbox.probe_network` tries it for real)."""
    missing = []
    if find_pasta() is None:
        missing.append("pasta")
    if libnftables() is None:
        missing.append("libnftables")
    if missing:
        return f"{' and '.join(missing)} not found: {INSTALL_HINT}"
    if not _tun_usable():
        return (
            "/dev/net/tun cannot be opened by job uids (pasta needs it): "
            "make it readable and writable by all (chmod 0666 /dev/net/tun, the udev default)"
        )
    return None


def _tun_usable() -> bool:
    try:
        st = os.stat("/dev/net/tun")
    except OSError:
        return False
    if st.st_mode & 0o006 == 0o006:
        return True  # every job uid may open it
    return os.geteuid() != 0 and os.access("/dev/net/tun", os.R_OK | os.W_OK)  # jobs run as this uid


def libnftables() -> str | None:
    """libnftables' name if it loads here (Debian's ``libnftables1``, with ``nftables``)."""
    for name in ("libnftables.so.1", ctypes.util.find_library("nftables")):
        if name:
            try:
                ctypes.CDLL(name)
            except OSError:
                continue
            return name
    return None


_library = functools.lru_cache(maxsize=1)(libnftables)  # the helper's, found once


def _id_args(uid: int | None, gid: int | None) -> list[str]:
    """The helper's UID GID arguments (``-``: stay the agent's); the helper's ``_ids`` reads them."""
    return [str(uid), str(gid if gid is not None else uid)] if uid is not None else ["-", "-"]


def read_child_pid(fd: int, timeout: float = SETUP_TIMEOUT_SECONDS) -> int | None:
    """The sandbox's first process, from bubblewrap's ``--info-fd`` (``None``: it ended first)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError, TypeError):
            continue  # not all of it yet
