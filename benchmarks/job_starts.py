"""What a job's start costs, measured inside a local machine's sandbox (``make bench ONLY=submit``
runs this file there: benchmarks/submit.py, ``sandbox_starts``). Imports only the agent's code.
"""

from __future__ import annotations

import sys
from typing import Any


def measure(samples: int) -> None:
    """Spawn-to-exit of ``true`` through each launcher, interleaved: prints JSON."""
    import json
    import os
    import subprocess
    import tempfile
    import time

    from catacloud.agent.netns import Egress, egress_problem, find_pasta, host_addresses
    from catacloud.agent.sandbox import BubblewrapLauncher, JobPlace, UidLauncher, bwrap_path, probe

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
    times: dict[str, list[float]] = {name: [] for name in launchers}
    for _ in range(samples):
        for name, launcher in launchers.items():
            launch = launcher.launch("true", {"PATH": "/usr/bin:/bin"}, place)
            began = time.perf_counter()
            try:
                proc = subprocess.Popen(launch.argv, cwd="/", **launch.popen_kwargs())
            finally:
                launch.close()
            if launch.network is not None:
                why = launch.network.run()
                if why is not None:
                    launch.network.abort(proc)
                    raise RuntimeError(why)
            proc.wait()
            times[name].append(time.perf_counter() - began)
            if launch.network is not None:
                launch.network.finish()
    print(json.dumps(times))


if __name__ == "__main__":
    measure(int(sys.argv[1]))
