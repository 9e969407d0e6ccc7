"""What a job's start costs, measured inside a local machine's sandbox (``make bench ONLY=submit``
runs this file there: benchmarks/submit.py, ``sandbox_starts``). Imports only the agent's code.
"""

from __future__ import annotations

import sys
from typing import Any

AHEAD = "bubblewrap sandbox + job network made ahead (nsenter)"
# A job that reads everything a TCP server sends and prints MB/s (through pasta's forward of an
# allowed loopback port: the path an operator's cache on the host takes).
READ = (
    "import socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
    "n = 0; t = time.perf_counter()\n"
    "while True:\n    b = s.recv(1 << 20)\n    n += len(b)\n    if not b: break\n"
    "print('MBPS', n / (time.perf_counter() - t) / 1e6, n)"
)


def measure(samples: int, throughput_port: int = 0) -> None:
    """Spawn-to-exit of ``true`` through each launcher, interleaved; then, with a port, what a
    job reads through the job network from a server on the host's loopback. Prints JSON."""
    import json
    import os
    import shlex
    import subprocess
    import tempfile
    import time

    from catacloud.agent.netns import Egress, egress_problem, find_pasta, host_addresses
    from catacloud.agent.sandbox import (
        BubblewrapLauncher,
        JobPlace,
        ReadyNetwork,
        UidLauncher,
        bwrap_path,
        probe,
    )

    uid = 2_000_000_000 + 99 if os.geteuid() == 0 else None
    folder = tempfile.mkdtemp(prefix="bench-", dir="/var/lib/catacloud")
    os.chmod(folder, 0o711)
    work = os.path.join(folder, "job")
    os.mkdir(work, 0o700)
    if uid is not None:
        os.chown(work, uid, uid)
    place = JobPlace(work_dir=work, socket_path="", uid=uid, gid=uid)
    bwrap = bwrap_path()
    launchers: dict[str, Any] = {"uid-only supervisor": UidLauncher()}
    if bwrap is not None:
        plain = BubblewrapLauncher(bwrap=bwrap, hostname="bench", hidden=[folder])
        if probe(plain, place) is None:
            launchers["bubblewrap sandbox, no network (loopback only)"] = plain
            if egress_problem() is None:
                networked = BubblewrapLauncher(
                    bwrap=bwrap, hostname="bench", hidden=[folder], proc=plain.proc
                )
                networked.egress = Egress(
                    "pasta", pasta=find_pasta() or "pasta", host_addresses=host_addresses()
                )
                launchers["bubblewrap sandbox + job network (rules, pasta)"] = networked
                ahead = BubblewrapLauncher(bwrap=bwrap, hostname="bench", hidden=[folder], proc=plain.proc)
                ahead.egress = networked.egress
                launchers[AHEAD] = ahead
    times: dict[str, list[float]] = {name: [] for name in launchers}
    made: list[float] = []
    for _ in range(samples):
        for name, launcher in launchers.items():
            if name == AHEAD:  # made while the machine idles: not part of the job's start
                launcher.prepare_network(uid, uid, (), folder)
            launch = launcher.launch("true", {"PATH": "/usr/bin:/bin"}, place)
            if name == AHEAD:
                assert isinstance(launch.network, ReadyNetwork), "no network made ahead"
                made.append(launch.network.made_ms / 1000)
            began = time.perf_counter()
            proc = launch.spawn()
            why = launch.begin(proc)
            if why is not None:
                raise RuntimeError(why)
            proc.wait()
            times[name].append(time.perf_counter() - began)
            launch.finish()
    result: dict[str, Any] = {"starts": times, "network_made_ahead_s": made}
    networked = launchers.get("bubblewrap sandbox + job network (rules, pasta)")
    if throughput_port and networked is not None:
        from catacloud.agent.netns import Allow

        allowed = JobPlace(
            work_dir=work,
            socket_path="",
            uid=uid,
            gid=uid,
            allow=(Allow.parse(f"127.0.0.1:{throughput_port}"),),
        )
        rates = []
        for _ in range(3):
            launch = networked.launch(f"python3 -c {shlex.quote(READ)} {throughput_port}", {}, allowed)
            proc = launch.spawn(stdout=subprocess.PIPE, text=True)
            why = launch.begin(proc)
            if why is not None:
                raise RuntimeError(why)
            out, _ = proc.communicate()
            launch.finish()
            rates += [float(line.split()[1]) for line in out.splitlines() if line.startswith("MBPS")]
        result["loopback_mb_per_s"] = rates
    print(json.dumps(result))


if __name__ == "__main__":
    measure(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
