"""The embedded default driver: a "machine" is a detached local process running the agent.

Config:
  ``state_dir`` (required): directory holding one JSON record per machine, ``<instance_id>.json``
      (pid, process start time, labels, name, created_at, log path), and its log
      ``<instance_id>.log`` (stdout and stderr). Records outlive the worker, so a restarted
      worker still lists, adopts and deletes its machines.
  ``boot_delay_seconds`` (float, default 0): the command starts only after this delay, so
      warming is visible. With a delay the process is ``python -c <sleep, then exec command>``;
      ``exec`` keeps the pid, so the record stays valid. Until ``created_at + delay`` the machine
      reports ``booting`` (PROVISIONING).
  ``stop_timeout_seconds`` (float, default 5): grace between SIGTERM and SIGKILL on delete.
  ``keep_logs`` (bool, default False): keep ``<instance_id>.log`` after delete.

Isolation: a local machine is a process on this host, not a VM. It gets none of the control
plane's environment (database and broker URLs, keys, passwords): only ``AGENT_ENV_ALLOWED``
plus ``spec.local_env``, and the bootstrap token in it is handed over as a 0600 file
(``<instance_id>.token``, removed by the agent once used) rather than in its environment, which
``/proc/<pid>/environ`` would show for the agent's whole life. The agent runs jobs as an
unprivileged user when it runs as root (see ``catacloud/agent/runner.py`` and SECURITY.md).

The provider id is the instance id. Processes start in their own session
(``start_new_session=True``), so restarting the Celery worker does not kill machines, and
delete signals the whole process group. The recorded start time guards against pid reuse: a
record whose pid now belongs to another process reports ``exited`` (GONE) and is never signalled.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import psutil

from catacloud.providers.base import (
    LABEL_INSTANCE,
    MachineSpec,
    MachineState,
    NotFound,
    Permanent,
    Provider,
    ProviderMachine,
)

# Sleep, then replace ourselves with the real command (same pid, same process group).
BOOT_SHIM = "import os, sys, time; time.sleep(float(sys.argv[1])); os.execvp(sys.argv[2], sys.argv[2:])"
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# psutil derives start times from boot time + clock ticks; allow for float noise only.
_START_TIME_TOLERANCE = 0.05
# The only variables of the control plane's environment a local agent inherits.
AGENT_ENV_ALLOWED = frozenset({"PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "CATACLOUD_JOB_USER"})
BOOTSTRAP_ENV = "CATACLOUD_BOOTSTRAP_TOKEN"
_RECORD_KEYS = frozenset(
    {"instance_id", "name", "pid", "create_time", "labels", "created_at", "ready_at", "log_path"}
)
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
        self.state_dir = Path(self.config["state_dir"])
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.boot_delay = float(self.config.get("boot_delay_seconds", 0) or 0)
        self.stop_timeout = float(self.config.get("stop_timeout_seconds", 5))
        self.keep_logs = bool(self.config.get("keep_logs", False))
        if self.boot_delay < 0 or self.stop_timeout < 0:
            raise Permanent("boot_delay_seconds and stop_timeout_seconds must be >= 0")

    # ---- the interface ------------------------------------------------------------------------

    def create(self, spec: MachineSpec) -> ProviderMachine:
        self._check_id(spec.instance_id)
        if not spec.local_command:
            raise Permanent("local machines need a bootstrap or spec.command (the agent command line)")
        with self._locked():
            record = self._read(spec.instance_id)
            if record is not None and self._process(record) is not None:
                return self._machine(record)  # adopt: idempotent create
            record = self._start(spec)
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
            self._stop(proc)
        with self._locked():
            current = self._read(provider_id)
            if current is not None and current["pid"] == record["pid"]:
                self._record_path(provider_id).unlink(missing_ok=True)
                self.state_dir.joinpath(f"{provider_id}.token").unlink(missing_ok=True)
                if not self.keep_logs:
                    Path(record["log_path"]).unlink(missing_ok=True)

    # ---- processes ----------------------------------------------------------------------------

    def _start(self, spec: MachineSpec) -> dict[str, Any]:
        argv = list(spec.local_command)
        env = {key: value for key, value in os.environ.items() if key in AGENT_ENV_ALLOWED}
        env.update(spec.local_env)
        token = env.pop(BOOTSTRAP_ENV, None)
        if token is not None:
            token_path = self.state_dir / f"{spec.instance_id}.token"
            fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token)
            argv += ["--bootstrap-token-file", str(token_path)]
        if self.boot_delay > 0:
            argv = [sys.executable, "-c", BOOT_SHIM, repr(self.boot_delay), *argv]
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
                    cwd=self.state_dir,
                )
            except OSError as exc:
                raise Permanent(f"cannot start {argv[0]!r}: {exc.strerror}") from exc
        _children[proc.pid] = proc
        return {
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

    def _stop(self, proc: psutil.Process) -> None:
        """SIGTERM the process group, wait up to ``stop_timeout``, then SIGKILL what is left."""
        pgid = proc.pid  # a session leader leads its own process group
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        _wait_gone(proc, self.stop_timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # stragglers: children that ignored SIGTERM
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
