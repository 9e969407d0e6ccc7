"""The embedded default driver: a "machine" is a sandboxed local agent on this host.

Config:
  ``state_dir`` (required): directory holding one JSON record per machine, ``<instance_id>.json``
      (pid, process start time, labels, name, created_at, log path), its log ``<instance_id>.log``
      (stdout and stderr) and its folder ``<instance_id>/`` (bootstrap token, enrollment, jobs'
      work, limits; ``/var/lib/catacloud`` inside the machine, as on a cloud machine). Records
      outlive the worker, so a restarted worker still lists, adopts and deletes its machines.
  ``sandbox`` (bool, default True unless ``CATACLOUD_LOCAL_SANDBOX=off``): run each machine in a
      bubblewrap sandbox (:mod:`catacloud.providers.machine_sandbox` says what it sees). Off is an
      explicit, weaker mode for hosts that cannot sandbox: the agent is a plain process (jobs still
      run as their own uid, never root, where the agent runs as root).
  ``mounts`` (list of ``{"source", "target", "writable"}``, default none): host folders shown
      inside every machine of the account, read-only unless ``writable`` (what a cloud machine's
      image would hold: a runner folder, a data set).
  ``pids_max`` (int, default 4096): the machine's process limit, with cpus and memory from its
      machine type, where the host allows a cgroup.
  ``boot_delay_seconds`` (float, default 0): the command starts only after this delay, so
      warming is visible. Until ``created_at + delay`` the machine reports ``booting``
      (PROVISIONING).
  ``disk_reserve_gb`` (float, default 2): free space the state folder's disk keeps for the
      control plane (``$CATACLOUD_HOME``, PostgreSQL, Redis): no new machine starts below it
      (``InsufficientCapacity``, saying so), and a machine's agent ends a job that brings the
      free space below it (``disk_limit_exceeded``), as it ends one that outgrows its machine
      type's ``disk_gb``.
  ``job_areas`` (bool, default True): a machine whose type sets ``disk_gb`` writes its jobs to a
      file system of that size of its own (catacloud/agent/disk.py), loop-mounted on its work
      folder where the control plane runs as root; False leaves its jobs to the disk watchdog
      alone (weaker: an instant allocation passes it), for hosts without loop devices.
  ``network_ahead`` (bool, default True): the agent makes the next job's network (namespaces,
      rules, pasta) while the machine idles, so a job's start waits for none of it; False makes
      each at its job's start (about 0.1 s more a job), as before (the benchmark compares both).
  ``max_machines`` (int, default none): at most this many live machines of the account; a
      create past it fails with ``InsufficientCapacity``, as a cloud out of a server type does
      (the machine type cools down and its jobs fall over to an alternative).
  ``imds_url`` (URL, default none): a spot machine's (machine type ``spot``) agent watches
      ``{imds_url}/{instance_id}`` for spot interruption notices as an EC2 machine watches its
      own metadata service (IMDSv2): a stand-in for spot handling on a laptop and in tests.
  ``imds_kind`` (``ec2`` or ``azure``, default ``ec2``): whose notices those are: EC2's
      ``spot/instance-action`` or Azure's Scheduled Events (a ``Preempt`` event).
  ``stop_timeout_seconds`` (float, default 5): grace between SIGTERM and SIGKILL on delete.
  ``keep_logs`` (bool, default False): keep ``<instance_id>.log`` after delete.
  ``unreachable_limit_seconds`` (float, default ``CATACLOUD_LOCAL_UNREACHABLE_LIMIT`` or 600; 0:
      never): an agent that has not reached its control plane for this long ends itself, and
      with it its machine (``catacloud agent --exit-when-unreachable``). A local machine has no
      purpose without its stack; a cloud machine's agent keeps trying (the reconciler reaps it).

The control plane's environment never reaches a machine: only ``AGENT_ENV_ALLOWED`` plus
``spec.local_env``, and the bootstrap token in it is handed over as a 0600 file in the machine's
folder (removed by the agent once used) rather than in its environment, which
``/proc/<pid>/environ`` would show for the agent's whole life.

The provider id is the instance id. Processes start in their own session
(``start_new_session=True``), so restarting the Celery worker does not kill machines. The
recorded start time guards against pid reuse: a record whose pid now belongs to another process
reports ``exited`` (GONE) and is never signalled.

**A machine dies with the process its record names.** A sandboxed machine's recorded process
is a small shell (the machine's keeper) that starts its bubblewrap sandbox and waits for it; the
sandbox runs with ``--die-with-parent``, so each process of the chain (the outer bubblewrap, its
first process inside, the agent) is SIGKILLed when the one above it ends, and the agent's jobs
die with the agent (their own sandboxes do the same). Ending the keeper by any signal, or any
process of the chain, ends everything below it. The sandbox's parent is the keeper, not the
Celery worker that started it: a worker that restarts leaves its machines running.

Every machine's processes on this host carry ``CATACLOUD_LOCAL_MACHINE=<its folder>`` in their
environment (the keeper, bubblewrap; not the agent inside the sandbox), so
:func:`machine_processes` finds a machine's processes even when its record is gone (a deleted
``$CATACLOUD_HOME``) or names a process that no longer runs.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import psutil

from catacloud.agent.disk import make_area, mounts_under, release_area
from catacloud.agent.sandbox import bwrap_path, gpu_devices
from catacloud.providers.base import (
    LABEL_INSTALLATION,
    LABEL_INSTANCE,
    InsufficientCapacity,
    MachineSpec,
    MachineState,
    NotFound,
    Permanent,
    Provider,
    ProviderMachine,
)
from catacloud.providers.machine_sandbox import (
    DEFAULT_PIDS_MAX,
    HOST_FIX,
    MACHINE_DIR,
    Cgroup,
    MachineSandbox,
    Mount,
    free_slot,
    job_uid_slot,
    own_slot,
    remove_cgroup,
    secrets_to_hide,
    tun_device,
)

# Sleep, then replace ourselves with the real command (same pid, same process group).
BOOT_SHIM = "import os, sys, time; time.sleep(float(sys.argv[1])); os.execvp(sys.argv[2], sys.argv[2:])"
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# psutil derives start times from boot time + clock ticks; allow for float noise only.
_START_TIME_TOLERANCE = 0.05
# The only variables of the control plane's environment a local agent inherits.
AGENT_ENV_ALLOWED = frozenset({"PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "CATACLOUD_PASTA"})
BOOTSTRAP_ENV = "CATACLOUD_BOOTSTRAP_TOKEN"
DEFAULT_DISK_RESERVE_GB = 2.0
# The mark of a machine's processes on this host: the machine's folder (absolute).
MACHINE_ENV = "CATACLOUD_LOCAL_MACHINE"
# The default of ``unreachable_limit_seconds``, from the control plane's environment.
UNREACHABLE_ENV = "CATACLOUD_LOCAL_UNREACHABLE_LIMIT"
DEFAULT_UNREACHABLE_LIMIT = 600.0
# The keeper: run the sandbox as a child (not exec: bubblewrap's parent must be a process that
# stays, and is the one the record names) and exit as it did. Any signal that ends the keeper
# ends the sandbox (--die-with-parent).
KEEPER = '"$@"; exit $?'
_RECORD_KEYS = frozenset(
    {"instance_id", "name", "pid", "create_time", "labels", "created_at", "ready_at", "log_path"}
)
# The agent's files inside its machine (the same places as on a cloud machine).
TOKEN_FILE = f"{MACHINE_DIR}/bootstrap-token"
STATE_FILE = f"{MACHINE_DIR}/agent/agent.json"
WORK_DIR = f"{MACHINE_DIR}/work"
LIMITS_FILE = f"{MACHINE_DIR}/limits.json"


def sandbox_default() -> bool:
    """``CATACLOUD_LOCAL_SANDBOX=off`` (or ``0``, ``false``, ``no``) opts out, for hosts that cannot."""
    return os.environ.get("CATACLOUD_LOCAL_SANDBOX", "on").strip().lower() not in ("off", "0", "false", "no")


def unreachable_limit_default() -> float:
    """``CATACLOUD_LOCAL_UNREACHABLE_LIMIT`` (seconds; 0: never), else 10 minutes."""
    raw = os.environ.get(UNREACHABLE_ENV, "").strip()
    return float(raw) if raw else DEFAULT_UNREACHABLE_LIMIT


# Popen objects of machines this process started: polling them reaps exited children and
# keeps Python from warning about "subprocess still running" when they are garbage collected.
_children: dict[int, subprocess.Popen[bytes]] = {}


class LocalProvider(Provider):
    kind = "local"
    needs_state_dir = True
    STATE_MAP: ClassVar[Mapping[str, MachineState]] = {
        "booting": MachineState.PROVISIONING,
        "running": MachineState.RUNNING,
        "stopping": MachineState.STOPPING,
        "exited": MachineState.GONE,
    }

    def __init__(self, *, config: Mapping[str, Any], credentials: Mapping[str, str]) -> None:
        super().__init__(config=config, credentials=credentials)
        if not self.config.get("state_dir"):
            raise Permanent("local provider needs config 'state_dir'")
        self.state_dir = Path(self.config["state_dir"]).absolute()  # machines' marks name it
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.boot_delay = float(self.config.get("boot_delay_seconds", 0) or 0)
        self.stop_timeout = float(self.config.get("stop_timeout_seconds", 5))
        self.keep_logs = bool(self.config.get("keep_logs", False))
        try:
            limit = self.config.get("unreachable_limit_seconds")
            self.unreachable_limit = unreachable_limit_default() if limit is None else float(limit)
        except (TypeError, ValueError) as exc:
            raise Permanent(f"local provider: unreachable limit: {exc}") from exc
        try:
            self.disk_reserve_gb = float(self.config.get("disk_reserve_gb", DEFAULT_DISK_RESERVE_GB))
        except (TypeError, ValueError):
            raise Permanent("disk_reserve_gb must be a number of GB") from None
        if self.disk_reserve_gb < 0:
            raise Permanent("disk_reserve_gb must be >= 0")
        if self.boot_delay < 0 or self.stop_timeout < 0 or self.unreachable_limit < 0:
            raise Permanent(
                "boot_delay_seconds, stop_timeout_seconds and unreachable_limit_seconds must be >= 0"
            )
        sandbox = self.config.get("sandbox")
        self.sandbox = sandbox_default() if sandbox is None else bool(sandbox)
        self.job_areas = bool(self.config.get("job_areas", True))
        self.network_ahead = bool(self.config.get("network_ahead", True))
        self.imds_url = str(self.config.get("imds_url") or "").rstrip("/")
        self.imds_kind = str(self.config.get("imds_kind") or "ec2")
        if self.imds_kind not in ("ec2", "azure"):
            raise Permanent(f"imds_kind must be ec2 or azure, not {self.imds_kind!r}")
        room = self.config.get("max_machines")
        if room is not None and (not isinstance(room, int) or isinstance(room, bool) or room < 0):
            raise Permanent(f"max_machines must be a whole number of at least 0, not {room!r}")
        self.max_machines = room
        try:
            self.mounts = [Mount.parse(raw) for raw in self.config.get("mounts") or []]
            self.pids_max = int(self.config.get("pids_max", DEFAULT_PIDS_MAX))
        except (TypeError, ValueError) as exc:
            raise Permanent(f"local provider config: {exc}") from exc

    # ---- the interface ------------------------------------------------------------------------

    def create(self, spec: MachineSpec) -> ProviderMachine:
        self._check_id(spec.instance_id)
        if not spec.local_command:
            raise Permanent("local machines need a bootstrap or spec.command (the agent command line)")
        with self._locked():
            record = self._read(spec.instance_id)
            if record is not None and self._process(record) is not None:
                return self._machine(record)  # adopt: idempotent create
            self._check_disk()
            self._check_room()
            try:
                record = self._start(spec)
            except BaseException:  # nothing of a machine that did not start stays mounted
                release_area(str(self.state_dir / spec.instance_id), str(self._area_file(spec.instance_id)))
                raise
            self._write(record)
        return self._machine(record)

    def get(self, provider_id: str) -> ProviderMachine:
        record = self._read(provider_id) if _SAFE_ID.match(provider_id) else None
        if record is None:
            raise NotFound(f"no local machine {provider_id}")
        return self._machine(record)

    def list(self, owner_labels: Mapping[str, str]) -> list[ProviderMachine]:
        machines = []
        for path in sorted(self.state_dir.glob("*.json")):
            record = self._read(path.stem)
            if record is None or not owner_labels.items() <= record["labels"].items():
                continue
            machine = self._machine(record)
            if machine.state is not MachineState.GONE:
                machines.append(machine)
        return machines

    def delete(self, provider_id: str) -> None:
        if not _SAFE_ID.match(provider_id):
            return  # cannot exist: nothing to delete
        with self._locked():
            record = self._read(provider_id)
        if record is None:
            return
        proc = self._process(record)
        if proc is not None:
            self._stop(proc, sandboxed=bool(record.get("sandbox")))
        with self._locked():
            current = self._read(provider_id)
            if current is not None and current["pid"] == record["pid"]:
                # What its record does not reach (a chain an older version left broken): by its mark.
                for leftover in machine_processes(self.state_dir / provider_id).values():
                    end_processes(leftover)
                self._record_path(provider_id).unlink(missing_ok=True)
                release_area(str(self.state_dir / provider_id), str(self._area_file(provider_id)))
                shutil.rmtree(self.state_dir / provider_id, ignore_errors=True)
                remove_cgroup(record.get("cgroup_folders") or [])
                if "slot" in record:
                    free_slot(record["slot"], provider_id)
                if not self.keep_logs:
                    Path(record["log_path"]).unlink(missing_ok=True)

    def _check_room(self) -> None:
        """At most ``max_machines`` live machines of this account: past it, no capacity."""
        if self.max_machines is None:
            return
        live = sum(
            1
            for path in self.state_dir.glob("*.json")
            if (record := self._read(path.stem)) is not None and self._process(record) is not None
        )
        if live >= self.max_machines:
            raise InsufficientCapacity(
                f"this local account holds at most {self.max_machines} machines (max_machines), "
                f"and {live} are running: no capacity for another"
            )

    def _check_disk(self) -> None:
        """No new machine while the disk the control plane lives on is below its reserve."""
        reserve = int(self.disk_reserve_gb * 10**9)
        if not reserve:
            return
        st = os.statvfs(self.state_dir)
        free = st.f_bavail * st.f_frsize
        if free < reserve:
            raise InsufficientCapacity(
                f"this host's disk has {free / 10**9:.1f} GB free, below the {self.disk_reserve_gb:g} GB "
                f"kept for the control plane ({self.state_dir}, PostgreSQL, Redis): no new local machine "
                "until space is freed (or lower the local provider account's disk_reserve_gb)"
            )

    # ---- processes ----------------------------------------------------------------------------

    def _start(self, spec: MachineSpec) -> dict[str, Any]:
        """Make the machine's folder and cgroup, then start its process (the agent, sandboxed)."""
        argv = list(spec.local_command)
        if shutil.which(argv[0]) is None:  # in a sandbox it would fail there, out of sight
            raise Permanent(f"cannot start {argv[0]!r}: no such executable")
        env = {key: value for key, value in os.environ.items() if key in AGENT_ENV_ALLOWED}
        env.update(spec.local_env)
        token = env.pop(BOOTSTRAP_ENV, None)
        folder = self._fresh_folder(spec.instance_id)
        env[MACHINE_ENV] = os.path.abspath(folder)
        record: dict[str, Any] = {"sandbox": self.sandbox}
        why_not = self._job_area(spec, folder, record)
        if token is not None:
            fd = os.open(
                folder / "bootstrap-token", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
            )
            with os.fdopen(fd, "w") as fh:
                fh.write(token)
            argv += ["--bootstrap-token-file", self._inside(folder, TOKEN_FILE)]
        cgroup = self._limits(spec, folder, record, disk_why_not=why_not)
        if spec.bootstrap is not None and not spec.command:
            argv += self._agent_args(spec, folder, record)
        if self.boot_delay > 0:
            argv = [sys.executable, "-c", BOOT_SHIM, repr(self.boot_delay), *argv]
        if self.sandbox:
            argv = self._sandboxed(spec, folder, argv)
            if cgroup is not None:
                argv = cgroup.wrap(argv)
        return self._spawn(spec, folder, argv, env, cgroup, record)

    def _fresh_folder(self, instance_id: str) -> Path:
        folder = self.state_dir / instance_id
        if folder.exists():
            release_area(str(folder), str(self._area_file(instance_id)))  # a machine that died
            shutil.rmtree(folder)  # its successor starts clean
        folder.mkdir(mode=0o711)
        os.chmod(folder, 0o711)  # the machine's job uids pass through to their work folders
        return folder

    def _inside(self, folder: Path, path: str) -> str:
        """An agent file's path as the agent sees it (its folder is MACHINE_DIR in the sandbox)."""
        return path if self.sandbox else str(folder) + path[len(MACHINE_DIR) :]

    def _area_file(self, instance_id: str) -> Path:
        """Where a machine's job area lives on this host (beside its folder, out of its sight)."""
        return self.state_dir / f"{instance_id}.disk"

    def _job_area(self, spec: MachineSpec, folder: Path, record: dict[str, Any]) -> str:
        """The machine's jobs' disk (its type's ``disk_gb``): a file system of that size mounted
        on its work folder, which its agent cannot mount itself (catacloud/agent/disk.py). Why
        there is none ("": there is one, or no limit to hold)."""
        if not spec.disk_gb:
            return ""
        if not self.job_areas:
            return "turned off in the local provider account's config (job_areas: false)"
        if not self.sandbox:
            return "an unsandboxed local machine's jobs write under /tmp"
        if os.geteuid() != 0:
            return "the control plane does not run as root, which loop-mounting a file system needs"
        image = self._area_file(spec.instance_id)
        made = make_area(str(folder / "work"), str(image), spec.disk_gb * 10**9)
        if isinstance(made, str):
            return made
        record["disk_image"] = str(image)
        return ""

    def _limits(
        self, spec: MachineSpec, folder: Path, record: dict[str, Any], *, disk_why_not: str = ""
    ) -> Cgroup | None:
        """The machine's size in a cgroup, whatever it runs; what holds goes to limits.json."""
        cgroup: Cgroup | None = None
        if self.sandbox:
            cgroup, limits = Cgroup.create(
                f"cc-{spec.instance_id}",
                installation=self._installation(spec),
                cpus=spec.cpus,
                memory_mb=spec.memory_mb,
                pids=self.pids_max,
            )
            if cgroup is not None:
                record["cgroup_folders"] = cgroup.folders
        else:
            limits = {"enforced": False, "detail": "not enforced: the local provider runs unsandboxed"}
        if disk_why_not:
            limits["disk_why_not"] = disk_why_not
        (folder / "limits.json").write_text(json.dumps(limits))
        return cgroup

    def _agent_args(self, spec: MachineSpec, folder: Path, record: dict[str, Any]) -> builtins.list[str]:
        """What the agent of a local machine is told: its files, its job uids, its limits."""
        args = ["--state-file", self._inside(folder, STATE_FILE)]
        if self.unreachable_limit > 0:
            args += ["--exit-when-unreachable", f"{self.unreachable_limit:g}"]
        if self.sandbox:  # unsandboxed, the agent makes one under /tmp, where job uids can pass
            args += ["--work-dir", WORK_DIR]
        if os.geteuid() == 0:
            slot, uids = job_uid_slot({"instance_id": spec.instance_id, "claimer": os.getpid()})
            record["slot"] = slot
            args += ["--job-uids", str(uids)]
        args += ["--limits-file", self._inside(folder, LIMITS_FILE)]
        args += ["--disk-reserve-gb", f"{self.disk_reserve_gb:g}"]
        if not self.network_ahead:
            args.append("--no-network-ahead")
        if self.imds_url and spec.spot:
            args += ["--imds-url", f"{self.imds_url}/{spec.instance_id}", "--imds-kind", self.imds_kind]
        if spec.disk_gb:
            args += ["--disk-gb", str(spec.disk_gb)]
        for mount in self.mounts:
            if mount.writable:
                args += ["--shared-dir", mount.target if self.sandbox else mount.source]
        return args

    def _sandboxed(self, spec: MachineSpec, folder: Path, argv: builtins.list[str]) -> builtins.list[str]:
        """``argv`` in the machine's sandbox, under its keeper (the process the record names)."""
        bwrap = bwrap_path()
        if bwrap is None:
            raise Permanent(f"local machines run in a bubblewrap sandbox, which is not installed: {HOST_FIX}")
        sandbox = MachineSandbox(
            bwrap=bwrap,
            hostname=spec.name,
            machine_dir=str(folder),
            mounts=self.mounts,
            hide=secrets_to_hide([str(self.state_dir)]),
            tun=tun_device(self.state_dir),
            unset_env=[MACHINE_ENV],  # a mark for this host, not a thing the machine needs
            devices=gpu_devices() if spec.gpus else (),  # a GPU type's machine sees the host's GPUs
            containers=spec.containers,
        )
        return ["/bin/sh", "-c", KEEPER, "catacloud-machine", *sandbox.argv(argv)]

    def _spawn(
        self,
        spec: MachineSpec,
        folder: Path,
        argv: builtins.list[str],
        env: dict[str, str],
        cgroup: Cgroup | None,
        record: dict[str, Any],
    ) -> dict[str, Any]:
        """Start the machine's process in a session of its own; its record."""
        log_path = self.state_dir / f"{spec.instance_id}.log"
        now = datetime.now(UTC)
        with open(log_path, "ab") as log:
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                    cwd=folder,
                )
            except OSError as exc:
                if cgroup is not None:
                    cgroup.remove()
                raise Permanent(f"cannot start {argv[0]!r}: {exc.strerror}") from exc
        _children[proc.pid] = proc
        record.update(
            {
                "instance_id": spec.instance_id,
                "name": spec.name,
                "pid": proc.pid,
                # The child is not reaped yet, so psutil can read its start time even if it exited.
                "create_time": psutil.Process(proc.pid).create_time(),
                "labels": {**spec.labels, LABEL_INSTANCE: spec.instance_id},
                "created_at": now.isoformat(),
                "ready_at": (now + timedelta(seconds=self.boot_delay)).isoformat(),
                "log_path": str(log_path),
            }
        )
        if "slot" in record:
            own_slot(
                record["slot"],
                {"instance_id": spec.instance_id, "pid": proc.pid, "create_time": record["create_time"]},
            )
        return record

    def _installation(self, spec: MachineSpec) -> str:
        """What names this installation's cgroup: its label, else (a bare provider, as in
        tests) its state folder."""
        label = spec.labels.get(LABEL_INSTALLATION)
        if label:
            return str(label)
        return "home-" + hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:12]

    @staticmethod
    def _process(record: Mapping[str, Any]) -> psutil.Process | None:
        """The recorded process if it is still running (and is still the same process)."""
        try:
            proc = psutil.Process(record["pid"])
            if abs(proc.create_time() - record["create_time"]) > _START_TIME_TOLERANCE:
                return None  # pid reused by an unrelated process
        except psutil.Error:
            return None
        return proc if _running(proc) else None

    def _stop(self, proc: psutil.Process, *, sandboxed: bool) -> None:
        """SIGTERM the agent (and what it started), wait up to ``stop_timeout``, then SIGKILL
        everything left. A sandbox's keeper and bubblewrap processes get no SIGTERM: they end
        when the agent does (and the end of any of them ends everything below it)."""
        tree = _tree(proc)
        for member in tree:
            with contextlib.suppress(psutil.Error):
                if member.name() != "bwrap" and not (sandboxed and member.pid == proc.pid):
                    member.send_signal(signal.SIGTERM)
        _wait_gone(proc, self.stop_timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # a session leader leads its own process group
        for member in [*tree, *_tree(proc)]:
            with contextlib.suppress(psutil.Error):
                member.send_signal(signal.SIGKILL)  # psutil refuses a reused pid
        _wait_gone(proc, 1.0)

    def _machine(self, record: Mapping[str, Any]) -> ProviderMachine:
        if self._process(record) is None:
            raw = "exited"
        elif datetime.now(UTC) < datetime.fromisoformat(record["ready_at"]):
            raw = "booting"
        else:
            raw = "running"
        return ProviderMachine(
            provider_id=record["instance_id"],
            name=record["name"],
            state=self.map_state(raw),
            labels=dict(record["labels"]),
            created_at=datetime.fromisoformat(record["created_at"]),
            public_ip="127.0.0.1",
            private_ip="127.0.0.1",
            raw_state=raw,
        )

    # ---- records ------------------------------------------------------------------------------

    @staticmethod
    def _check_id(instance_id: str) -> None:
        if not _SAFE_ID.match(instance_id):
            raise Permanent(f"instance id {instance_id!r} is not usable as a file name")

    def _record_path(self, instance_id: str) -> Path:
        return self.state_dir / f"{instance_id}.json"

    def _read(self, instance_id: str) -> dict[str, Any] | None:
        try:
            record = json.loads(self._record_path(instance_id).read_text())
        except (OSError, ValueError):
            return None  # missing, unreadable or not JSON
        if not isinstance(record, dict) or not record.keys() >= _RECORD_KEYS:
            return None  # a foreign file, not one of ours
        return record

    def _write(self, record: Mapping[str, Any]) -> None:
        path = self._record_path(record["instance_id"])
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: readers see the old record or the new one

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialize record changes across threads and worker processes sharing ``state_dir``."""
        with open(self.state_dir / ".lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)


def machine_processes(root: Path | str) -> dict[str, list[psutil.Process]]:
    """The processes of this host's local machines whose folder is ``root`` or under it (one
    machine's folder, a state dir, a ``$CATACLOUD_HOME/machines``), by machine folder. Found by
    their mark (:data:`MACHINE_ENV`), not by records: a machine whose record was deleted, or
    names a process that is gone, is found all the same."""
    base = os.path.abspath(root).rstrip("/")
    found: dict[str, list[psutil.Process]] = {}
    for proc in psutil.process_iter():
        try:
            folder = proc.environ().get(MACHINE_ENV)
        except psutil.Error:
            continue  # gone, a kernel thread, or not ours to read
        if folder and (folder == base or folder.startswith(base + "/")):
            found.setdefault(folder, []).append(proc)
    return found


def release_areas(root: Path | str) -> list[str]:
    """Unmount every job area under ``root`` (a state folder, ``$CATACLOUD_HOME/machines``) and
    remove their files: what stopping every machine there leaves (an area outlives its machine's
    processes until it is released). The mount points released."""
    points = mounts_under(str(root))
    for point in points:
        release_area(point)
    for image in Path(root).glob("**/*.disk"):
        with contextlib.suppress(OSError):
            if image.is_file() and not image.is_symlink():
                image.unlink()
    return points


def end_processes(procs: list[psutil.Process], timeout: float = 5.0) -> list[psutil.Process]:
    """SIGKILL ``procs`` (a machine's sandbox takes down everything in it); those still running
    after ``timeout`` seconds are returned."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()  # psutil refuses a pid that another process took meanwhile
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if _running(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def _running(proc: psutil.Process) -> bool:
    """True while ``proc`` runs; an exited child of ours is reaped, a zombie counts as dead."""
    child = _children.get(proc.pid)
    if child is not None and child.poll() is not None:
        _children.pop(proc.pid, None)
        return False
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(proc: psutil.Process, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _running(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
