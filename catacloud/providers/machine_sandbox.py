"""A local machine is a sandbox on this host (bubblewrap), not a bare process.

What a machine sees is listed, not filtered: the host's system folders read-only (``/usr``,
``/etc``, ``/bin``, ``/lib*``, ``/sbin``), the agent's Python (its venv, its interpreter and the
``catacloud`` package) read-only, the operator's ``mounts`` (read-only unless said otherwise), and
its own machine folder, writable, at :data:`MACHINE_DIR`; fresh ``/proc``, ``/dev``, ``/tmp``,
``/run`` and ``/var``. Everything else is absent: ``$CATACLOUD_HOME`` (passwords, keys, the
artifact store), the project checkout, home folders, other machines' folders and logs. The
machine has its own PID, IPC and UTS namespaces (its hostname is the machine's name), so it sees
and signals only its own processes. What a job may touch therefore never depends on the modes
of the host's folders.

An agent started as root keeps root inside (with only the capabilities it needs to run jobs as
other uids: setuid, setgid, chown, fowner, kill, dac_override, dac_read_search; and sys_ptrace,
to read its own jobs' open files), and runs each job as a uid of the range the provider gave its
machine; any other user gets a user namespace (bubblewrap's default), and the agent runs jobs in
nested ones. Either way no job is root.

:class:`Cgroup` puts the machine under its machine type's limits (cpus, memory, pids) where the
host lets us (cgroup v2 or v1, as root); :func:`job_uid_slot` gives each machine of this host its
own range of job uids.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from catacloud.agent.netns import INSTALL_HINT, find_pasta, libnftables
from catacloud.agent.sandbox import JOB_UID_BASE, UidRange, bwrap_path

# Where a machine finds its own folder (bootstrap token, enrollment, work, limits), as on a cloud
# machine (catacloud/providers/userdata.py).
MACHINE_DIR = "/var/lib/catacloud"
SYSTEM_FOLDERS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
AGENT_CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    # The disk watchdog reads its jobs' open files (/proc/<pid>/fd: a deleted file a job keeps
    # open counts) where no file system bounds them; it sees only its own machine's processes.
    "CAP_SYS_PTRACE",
)
# Job uid ranges of local machines: slot N holds UIDS_PER_MACHINE uids from JOB_UID_BASE + 2^16
# (the first 2^16 are cloud machines' default range), one slot per running machine of the host.
UIDS_PER_MACHINE = 1024
UID_SLOTS = 100_000
SLOTS_DIR = Path("/run/catacloud/job-uid-slots")
DEFAULT_PIDS_MAX = 4096


@dataclass(frozen=True)
class Mount:
    """A host folder shown inside every machine of an account (``mounts`` in its config)."""

    source: str
    target: str
    writable: bool = False

    @classmethod
    def parse(cls, raw: Any) -> Mount:
        if not isinstance(raw, Mapping) or not raw.get("source") or not raw.get("target"):
            raise ValueError("each mount needs 'source' and 'target' (absolute paths)")
        source, target = str(raw["source"]), str(raw["target"])
        if not (os.path.isabs(source) and os.path.isabs(target)) or ".." in Path(target).parts:
            raise ValueError(f"mount {source} -> {target}: both must be absolute, without '..'")
        return cls(source, os.path.normpath(target), bool(raw.get("writable", False)))


def runtime_paths() -> list[str]:
    """What the agent needs of this host to run: its venv, its interpreter, the catacloud package
    (found by the agent's own folder: on an enrolled host with the agent alone, ``catacloud`` is
    a namespace package with no file of its own)."""
    import catacloud.agent

    paths = {
        os.path.realpath(sys.prefix),
        os.path.realpath(sys.base_prefix),
        os.path.dirname(os.path.realpath(sys.executable)),
        os.path.dirname(os.path.dirname(os.path.realpath(catacloud.agent.__file__))),
    }
    # Keep only the outermost of nested paths (a venv inside the package's checkout and so on).
    ordered = sorted(paths, key=len)
    return sorted(
        p for p in ordered if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in ordered)
    )


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


# A machine whose jobs run containers starts with this: its own /proc, then CAP_SYS_ADMIN dropped
# (catacloud/providers/fresh_proc.py says why).
FRESH_PROC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fresh_proc.py")


@dataclass
class MachineSandbox:
    """The bubblewrap command line of one local machine."""

    bwrap: str
    hostname: str
    machine_dir: str  # on the host; MACHINE_DIR inside
    mounts: Sequence[Mount] = ()
    hide: Sequence[str] = ()  # host folders that must stay invisible even under a mount
    as_root: bool = field(default_factory=lambda: os.geteuid() == 0)
    tun: str | None = None  # a tun device every uid may open: pasta gives jobs the internet with it
    unset_env: Sequence[str] = ()  # variables of bubblewrap's own environment the command does not get
    devices: Sequence[str] = ()  # device nodes of the host the machine gets (an enrolled host's GPUs)
    # A machine whose type allows containers (its jobs' engines): the host's /sys, read-only but
    # for an empty /sys/fs/cgroup (a cloud machine has its own /sys; Podman reads the cgroup file
    # system's kind there, and its containers get no cgroup of their own), and, as root,
    # a /proc of the machine's own that a job's sandbox may mount again (see FRESH_PROC).
    containers: bool = False

    def argv(self, command: Sequence[str]) -> list[str]:
        args = [self.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", self.hostname]
        # The sandbox ends with the process that started it: SIGKILL to each of its processes in
        # turn (bubblewrap, its first process inside, the command), whatever ended the parent.
        args += ["--die-with-parent", *(a for name in self.unset_env for a in ("--unsetenv", name))]
        fresh_proc = self.containers and self.as_root
        if self.as_root:
            args += ["--cap-drop", "ALL"]
            for cap in (*AGENT_CAPABILITIES, *(["CAP_SYS_ADMIN", "CAP_SETPCAP"] if fresh_proc else [])):
                args += ["--cap-add", cap]
        else:
            args += ["--unshare-user"]
        for folder in SYSTEM_FOLDERS:
            if os.path.islink(folder):
                args += ["--symlink", os.readlink(folder), folder]
            elif os.path.isdir(folder):
                args += ["--ro-bind", folder, folder]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run", "--tmpfs", "/var"]
        if self.tun is not None:
            args += ["--perms", "0755", "--dir", "/dev/net", "--dev-bind", self.tun, "/dev/net/tun"]
        for device in self.devices:
            args += ["--dev-bind", device, device]
        if self.containers:  # /sys, but not the host's cgroup tree (other machines' names, limits)
            args += [
                "--ro-bind",
                "/sys",
                "/sys",
                "--tmpfs",
                "/sys/fs/cgroup",
                "--remount-ro",
                "/sys/fs/cgroup",
            ]
        args += ["--perms", "1777", "--dir", "/var/tmp", "--symlink", "/run", "/var/run"]  # as Debian has it
        made = {"/tmp", "/run", "/var", *SYSTEM_FOLDERS}
        binds = [(p, p, False) for p in runtime_paths()]
        binds += [(m.source, m.target, m.writable) for m in self.mounts]
        binds.append((self.machine_dir, MACHINE_DIR, True))
        for source, target, writable in binds:
            for parent in _ancestors(target):  # bubblewrap would make them 0700: jobs pass through
                if parent not in made and not any(
                    parent == t or parent.startswith(t + "/") for t in SYSTEM_FOLDERS
                ):
                    args += ["--perms", "0755", "--dir", parent]
                    made.add(parent)
            args += ["--bind" if writable else "--ro-bind", source, target]
        for secret in self.hide:
            for source, target, _w in binds:
                if secret == source or secret.startswith(source.rstrip("/") + "/"):
                    args += ["--tmpfs", target + secret[len(source) :]]
        args += ["--chdir", MACHINE_DIR, "--"]
        if fresh_proc:
            args += [sys.executable, "-I", FRESH_PROC]
        return [*args, *command]

    def check(self) -> str | None:
        """Start ``true`` in such a sandbox; ``None`` when this host can, else what went wrong."""
        try:
            result = subprocess.run(
                self.argv(["/bin/true"]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=30,
                env={"PATH": "/usr/bin:/bin"},
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return str(exc)
        if result.returncode != 0:
            return result.stderr.decode(errors="replace").strip() or f"exit code {result.returncode}"
        return None


# -- resource limits ---------------------------------------------------------------------------


CGROUP_ROOT = "/sys/fs/cgroup"
V1_CONTROLLERS = ("cpu", "memory", "pids")
PERIOD_US = 100_000


def host_cpus() -> int:
    """The CPUs this process may run on (the host's, or fewer where it is confined)."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def own_cgroup(controller: str | None = None) -> str:
    """This process's cgroup path (v2: ``controller`` None; v1: that controller's hierarchy)."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return "/"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (controller is None and controllers == "") or (
            controller is not None and controller in controllers.split(",")
        ):
            return path or "/"
    return "/"


@dataclass
class Cgroup:
    """One machine's cgroup (v2, else v1 per controller), when the host lets us make one.

    Machines live under their installation's own cgroup, ``catacloud-<installation>``, made
    inside the control plane's own cgroup (its delegated subtree, where a service manager gives
    it one), so two installations on a host never share a parent. The installation's cgroup
    caps all its machines together at this host's CPUs and yields to the control plane under
    contention (half the default CPU weight); each machine gets at most its machine type's
    CPUs, memory and processes."""

    name: str
    parent: str = "catacloud"  # the installation's cgroup (a folder name)
    procs: list[str] = field(default_factory=list)  # cgroup.procs files the machine joins
    folders: list[str] = field(default_factory=list)
    where: str = ""  # the machine's cgroup path, as reported

    @classmethod
    def create(
        cls, name: str, *, installation: str, cpus: int, memory_mb: int, pids: int
    ) -> tuple[Cgroup | None, dict[str, Any]]:
        """The cgroup and the limits record the agent reports (``enforced`` says whether they hold)."""
        total = host_cpus()
        cpus = max(1, min(cpus, total))
        limits: dict[str, Any] = {"cpus": cpus, "memory_mb": memory_mb, "pids": pids}
        group = cls(name, parent=installation_cgroup(installation))
        try:
            if os.path.exists(f"{CGROUP_ROOT}/cgroup.controllers"):
                group._make_v2(cpus, memory_mb, pids, total)
                how = "cgroup v2"
            elif os.path.isdir(f"{CGROUP_ROOT}/memory"):
                group._make_v1(cpus, memory_mb, pids, total)
                how = "cgroup v1"
            else:
                raise OSError("no cgroup file system at /sys/fs/cgroup")
        except OSError as exc:
            group.remove()
            reason = exc.strerror or str(exc)
            if isinstance(exc, PermissionError) or os.geteuid() != 0:
                reason = f"{reason} (limits need a control plane running as root, or a delegated cgroup)"
            return None, {
                **limits,
                "enforced": False,
                "detail": f"not enforced: cannot create a cgroup: {reason}",
            }
        detail = (
            f"enforced by {how} at {group.where}; the installation's machines share at most "
            f"{total} CPUs (this host's)"
        )
        return group, {
            **limits,
            "enforced": True,
            "host_cpus": total,
            "cgroup": group.where,
            "detail": detail,
        }

    def _make(self, root: str, own: str) -> tuple[str, str]:
        """The installation's folder (made if missing) and this machine's, under ``root/own``."""
        parent = os.path.join(root + own.rstrip("/"), self.parent)
        folder = os.path.join(parent, self.name)
        for attempt in range(3):  # the installation's last machine may remove the parent meanwhile
            try:
                os.makedirs(folder, exist_ok=True)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        self.folders.append(folder)
        self.where = f"{own.rstrip('/')}/{self.parent}/{self.name}"
        return parent, folder

    def _make_v2(self, cpus: int, memory_mb: int, pids: int, total: int) -> None:
        own = own_cgroup()
        base = CGROUP_ROOT + own.rstrip("/")
        # Controllers reach a child only through every level's subtree_control; a non-root
        # cgroup that holds processes refuses (EBUSY): then its manager must delegate us a leaf.
        _write(base, "cgroup.subtree_control", "+cpu +memory +pids")
        parent, folder = self._make(CGROUP_ROOT, own)
        _write(parent, "cgroup.subtree_control", "+cpu +memory +pids")
        _write(parent, "cpu.max", f"{total * PERIOD_US} {PERIOD_US}")
        with contextlib.suppress(OSError):
            _write(parent, "cpu.weight", "50")
        _write(folder, "cpu.max", f"{cpus * PERIOD_US} {PERIOD_US}")
        _write(folder, "memory.max", str(memory_mb * 2**20))
        _write(folder, "pids.max", str(pids))
        self.procs = [os.path.join(folder, "cgroup.procs")]

    def _make_v1(self, cpus: int, memory_mb: int, pids: int, total: int) -> None:
        cpu_parent, cpu = self._make(f"{CGROUP_ROOT}/cpu", own_cgroup("cpu"))
        _write(cpu_parent, "cpu.cfs_period_us", str(PERIOD_US))
        _write(cpu_parent, "cpu.cfs_quota_us", str(total * PERIOD_US))
        with contextlib.suppress(OSError):
            _write(cpu_parent, "cpu.shares", "512")
        _write(cpu, "cpu.cfs_period_us", str(PERIOD_US))
        _write(cpu, "cpu.cfs_quota_us", str(cpus * PERIOD_US))
        _, memory = self._make(f"{CGROUP_ROOT}/memory", own_cgroup("memory"))
        _write(memory, "memory.limit_in_bytes", str(memory_mb * 2**20))
        with contextlib.suppress(OSError):  # not every kernel accounts swap
            _write(memory, "memory.memsw.limit_in_bytes", str(memory_mb * 2**20))
        folders = [cpu, memory]
        if os.path.isdir(f"{CGROUP_ROOT}/pids"):
            _, task = self._make(f"{CGROUP_ROOT}/pids", own_cgroup("pids"))
            _write(task, "pids.max", str(pids))
            folders.append(task)
        self.where = f"{own_cgroup('cpu').rstrip('/')}/{self.parent}/{self.name}"
        self.procs = [os.path.join(f, "cgroup.procs") for f in folders]

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` started inside this cgroup: a shell joins it, then becomes ``argv`` (same pid)."""
        join = (
            'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done;'
            ' exec "$@"'
        )
        return ["/bin/sh", "-c", join, "sh", str(len(self.procs)), *self.procs, *argv]

    def remove(self, wait: float = 2.0) -> None:
        """Remove the folders, then the installation's where this was its last machine (left, one
        a test or a `make dev` run, they piled up by the hundred: every empty cgroup still costs
        the kernel's scheduler and memory accounting). A cgroup whose last process is still
        exiting refuses (EBUSY) for a moment after the kill: try again for up to ``wait`` seconds
        rather than leave it."""
        deadline = time.monotonic() + wait
        for folder in reversed(self.folders):
            while True:
                try:
                    os.rmdir(folder)
                except OSError as exc:
                    if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                break
            parent = os.path.dirname(folder)
            if os.path.basename(parent).startswith("catacloud-"):
                with contextlib.suppress(OSError):  # another machine of it lives on: kept
                    os.rmdir(parent)


def installation_cgroup(installation: str) -> str:
    """The folder name of an installation's cgroup: ``catacloud-<installation>``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in installation)[:64] or "default"
    return f"catacloud-{safe}"


def remove_cgroup(folders: Sequence[str]) -> None:
    """Remove a machine's cgroup folders (after its processes are gone), as its record lists them."""
    Cgroup("", folders=list(folders)).remove()


def _write(folder: str, name: str, value: str) -> None:
    with open(os.path.join(folder, name), "w") as fh:
        fh.write(value)


# -- job uid ranges ----------------------------------------------------------------------------


def job_uid_slot(owner: Mapping[str, Any], *, slots_dir: Path = SLOTS_DIR) -> tuple[int, UidRange]:
    """Claim a range of job uids no other running machine of this host holds: a file per slot,
    created exclusively, naming its owner (``pid`` and ``create_time`` of the machine's process,
    filled in by :func:`own_slot` once it runs). A slot whose owner process is gone is free."""
    slots_dir.mkdir(parents=True, exist_ok=True)
    for slot in range(UID_SLOTS):
        path = slots_dir / str(slot)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if not _stale(path):
                continue
            with contextlib.suppress(OSError):
                path.unlink()
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue  # another machine took it meanwhile
        with os.fdopen(fd, "w") as fh:
            json.dump(dict(owner), fh)
        return slot, slot_uids(slot)
    raise OSError("every job uid slot of this host is taken")


def slot_uids(slot: int) -> UidRange:
    return UidRange(JOB_UID_BASE + 2**16 + slot * UIDS_PER_MACHINE, UIDS_PER_MACHINE)


def own_slot(slot: int, owner: Mapping[str, Any], *, slots_dir: Path = SLOTS_DIR) -> None:
    tmp = slots_dir / f".{slot}.tmp"
    tmp.write_text(json.dumps(dict(owner)))
    os.replace(tmp, slots_dir / str(slot))


def free_slot(slot: int, instance_id: str, *, slots_dir: Path = SLOTS_DIR) -> None:
    path = slots_dir / str(slot)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("instance_id") == instance_id:
            path.unlink()


def _stale(path: Path) -> bool:
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # being written
    if "pid" not in owner:
        # Claimed, its machine not started yet: stale only if the claimer is gone.
        claimer = owner.get("claimer")
        return claimer is None or not psutil.pid_exists(int(claimer))
    try:
        return abs(psutil.Process(int(owner["pid"])).create_time() - float(owner["create_time"])) > 0.05
    except (psutil.Error, ValueError, TypeError):
        return True


TUN_MAJOR, TUN_MINOR = 10, 200


def tun_device(folder: Path) -> str | None:
    """A tun device node every uid may open, for the machines' job networks (catacloud/agent/
    netns.py: pasta opens ``/dev/net/tun`` as the job's uid): the host's when it is open to all
    (the udev default), else, as root, a node of our own in ``folder`` (the host's is left as it
    is); ``None`` when neither works (jobs then get no network, and say why)."""
    host = "/dev/net/tun"
    with contextlib.suppress(OSError):
        if os.stat(host).st_mode & 0o006 == 0o006:
            return host
    if os.geteuid() != 0:
        return None
    node = folder / "tun"
    try:
        st = os.stat(node)
        if not (stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(TUN_MAJOR, TUN_MINOR)):
            node.unlink()
            raise FileNotFoundError
    except FileNotFoundError:
        try:
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(TUN_MAJOR, TUN_MINOR))
        except FileExistsError:
            pass  # another worker made it meanwhile
        except OSError:
            return None
    try:
        os.chmod(node, 0o666)
        os.close(os.open(node, os.O_RDWR))  # a file system mounted nodev refuses it here
    except OSError:
        return None
    return str(node)


def network_problem(folder: Path) -> str | None:
    """Why jobs on this host's local machines would get no network (``None``: they get the
    internet through pasta, and nothing else)."""
    missing = [name for name, found in (("pasta", find_pasta()), ("libnftables", libnftables())) if not found]
    if missing:
        return f"{' and '.join(missing)} not found: {INSTALL_HINT}"
    if tun_device(folder) is None:
        return (
            "/dev/net/tun cannot be opened by every uid, and only root may make a node of its own: "
            "sudo chmod 0666 /dev/net/tun (the udev default)"
        )
    return None


def secrets_to_hide(extra: Iterable[str] = ()) -> list[str]:
    """Host folders no machine may see even if a mount or the runtime contains them."""
    home = os.environ.get("CATACLOUD_HOME", ".catacloud")
    return sorted({os.path.realpath(os.path.expanduser(home)), *extra})


HOST_FIX = (
    "allow user namespaces (sudo sysctl -w kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 also "
    "sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0) or install bubblewrap "
    "(apt install bubblewrap); or run local machines unsandboxed, a weaker mode in which jobs "
    "still never run as root: CATACLOUD_LOCAL_SANDBOX=off"
)


def host_problem() -> str | None:
    """Why this host cannot run a local machine's sandbox (``None``: it can)."""
    bwrap = bwrap_path()
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    with tempfile.TemporaryDirectory(prefix="catacloud-check-") as folder:
        os.chmod(folder, 0o711)
        return MachineSandbox(bwrap=bwrap, hostname="catacloud-check", machine_dir=folder).check()
