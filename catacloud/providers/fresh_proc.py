"""First process of a local machine whose jobs run containers: mount the machine's own /proc,
give up CAP_SYS_ADMIN for good, then become the command (``fresh_proc.py COMMAND...``).

bubblewrap's ``--proc`` leaves read-only mounts over parts of /proc (sys, irq, bus,
sysrq-trigger), and the kernel lets a nested user namespace mount a new /proc only where one
without such mounts is already visible (fs/namespace.c, ``mnt_already_visible``). A job's sandbox
in such a machine could then only bind its machine's /proc, where a container engine's processes
(in the job's own PID namespace) are not found. Mounted here, as a cloud machine's /proc is, the
job's sandbox mounts one of its own.

CAP_SYS_ADMIN (and CAP_SETPCAP, held for this alone) are then dropped from the bounding set and
from the effective, permitted and inheritable sets (the ambient set follows): bubblewrap runs the
machine with ``no_new_privs``, so no later ``execve`` of this process tree can get them back (the
kernel caps a no_new_privs exec at the old permitted set).
Run by path with the machine's Python (``-I``), before anything of the agent is imported.
"""

from __future__ import annotations

import ctypes
import os
import sys

CAP_SETPCAP = 8
CAP_SYS_ADMIN = 21
PR_CAPBSET_DROP = 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_caps(libc: ctypes.CDLL, *caps: int) -> None:
    """``caps`` gone from every set of this process (the bounding set first: that needs
    CAP_SETPCAP, which goes last)."""
    for cap in caps:
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"dropping capability {cap} from the bounding set")
    header = _Header(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for cap in caps:
        word, bit = divmod(cap, 32)
        for field in ("effective", "permitted", "inheritable"):
            setattr(data[word], field, getattr(data[word], field) & ~(1 << bit))
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def main(argv: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting the machine's /proc: {os.strerror(err)}")
    drop_caps(libc, CAP_SYS_ADMIN, CAP_SETPCAP)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
