"""The supervisor of a job where bubblewrap cannot run (``UidLauncher``): run by path as
``python -I supervise.py AGENT_PID FD``.

A child subreaper whose parent-death signal is tied to the agent (when the agent dies, even by
SIGKILL, it SIGKILLs every descendant of the job). It reads the job from the anonymous file
``FD`` (``{"command", "env", "cwd", "uid", "gid"}``), forbids new privileges, and starts
``/bin/sh`` as the job's uid with the job's environment (applied by that exec, after the uid
change: the job's variables never reach this process). When the shell exits it ends what the
shell left behind (SIGTERM, a second, SIGKILL) and exits as the shell did.

It imports only the standard library at start (``psutil`` when the job ends), so starting a
job stays quick; it is a module of its own so lint and the type checker read it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)
_dying: list[bool] = []


def descendants() -> list[Any]:
    import psutil  # only when the job ends: starting the job stays quick

    try:
        return list(psutil.Process().children(recursive=True))
    except psutil.Error:
        return []


def running(process: Any) -> bool:
    import psutil

    try:
        return bool(process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def end_all(signum: int, grace: float) -> None:
    """Signal every descendant once, then SIGKILL what is left after ``grace`` seconds."""
    deadline = time.monotonic() + grace
    sent: set[int] = set()
    while time.monotonic() < deadline + 5:  # a zombie whose parent never reaps it: give up
        processes = [p for p in descendants() if running(p)]
        if not processes:
            return
        kill = time.monotonic() >= deadline
        for process in processes:
            if kill or process.pid not in sent:  # SIGTERM once each, then SIGKILL after the grace
                with contextlib.suppress(Exception):  # psutil.Error: it is gone
                    process.send_signal(signal.SIGKILL if kill else signum)
                sent.add(process.pid)
        reap()
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    agent = int(argv[0])
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def agent_died(*_: object) -> None:
        # The death signal comes each time a thread of the agent exits (we are re-parented to
        # another of its threads): act only once the agent process itself is gone, and only once.
        if _dying or os.getppid() == agent:
            return
        _dying.append(True)
        end_all(signal.SIGKILL, 0)
        os._exit(137)

    signal.signal(signal.SIGUSR1, agent_died)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    agent_died()  # the agent may have died before we asked to be told
    with os.fdopen(int(argv[1]), "rb") as fh:
        job = json.loads(fh.read())
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid binary gives the job more

    def ignore(signum: int, frame: FrameType | None) -> None:
        return None  # the job's group gets them; a handler resets on exec

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, ignore)
    drop: dict[str, Any] = {}
    if job["uid"] is not None:
        drop = {"user": job["uid"], "group": job["gid"], "extra_groups": []}
    child = subprocess.Popen(["/bin/sh", "-c", job["command"]], env=job["env"], cwd=job["cwd"], **drop)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            status = 0
            break
        if pid == child.pid:
            break
    end_all(signal.SIGTERM, 1.0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
