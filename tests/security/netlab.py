"""A small network of the test's own: a network namespace on this host, reached over a veth
pair, that holds a "public" address (the internet, for a job), a private one (an operator's
LAN) and a link-local one (where a cloud's metadata service would be). Servers in it answer
every connection with the address and port they were reached at.

Every destination a job tries in these tests is on this host's loopback or in this namespace:
no packet is meant for any other address. Needs root and iproute2 (``ip netns``).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

PUBLIC = "198.51.100.77"  # TEST-NET-2: not refused to jobs, and no real host answers it
PRIVATE = "10.77.0.1"  # RFC 1918
LINK_LOCAL = "169.254.77.77"  # the metadata address's range (not the metadata address itself)
PORTS = (8080, 8081)

SERVER = r"""
import socket, sys, threading
def serve(sock):
    while True:
        conn, _ = sock.accept()
        host, port = conn.getsockname()[:2]
        conn.sendall(f"LAB:{host}:{port}\n".encode())
        conn.close()
for port in map(int, sys.argv[1:]):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
"""


def available() -> str | None:
    """Why this host cannot make the lab (``None``: it can)."""
    import os

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

    @classmethod
    def start(cls) -> Lab:
        tag = secrets.token_hex(3)
        lab = cls(name=f"cc-lab-{tag}", host_if=f"cch{tag}")
        inner = f"ccl{tag}"
        try:
            _ip("netns", "add", lab.name)
            _ip("link", "add", lab.host_if, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", lab.name)
            _ip("link", "set", lab.host_if, "up")
            ns = ["-n", lab.name]
            _ip(*ns, "link", "set", "lo", "up")
            _ip(*ns, "link", "set", inner, "up")
            for address in (PUBLIC, PRIVATE, LINK_LOCAL):
                _ip(*ns, "addr", "add", f"{address}/32", "dev", inner)
                _ip("route", "add", f"{address}/32", "dev", lab.host_if)
            _ip(*ns, "route", "add", "default", "dev", inner)
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
        for address in (PUBLIC, PRIVATE, LINK_LOCAL):
            while True:
                try:
                    assert reach(address, PORTS[0]) == f"LAB:{address}:{PORTS[0]}"
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    def stop(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait()
        for address in (PUBLIC, PRIVATE, LINK_LOCAL):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("route", "del", f"{address}/32", "dev", self.host_if)
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
