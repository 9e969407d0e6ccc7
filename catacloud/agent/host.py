"""``catacloud host``: a machine the user owns, enrolled with Catacloud (bare metal, a long-lived VM).

The host enrolls once with an enrolment token (its own credential is then kept, 0600, in
``--state-file``: a restarted host resumes, it never enrolls again), reports what it has
(cpus, memory, disk, GPUs, arch: all it has, or less with ``--cpus`` and the like), and runs
what the control plane tells it to: **slots**. Each slot is a machine of its own on this host,
made as the local provider makes one (catacloud/providers/local.py): a sandbox of the slot's
cpus, memory and processes (a cgroup, where this runs as root), its own range of job uids, its
disk of its machine type's size (a file system of its own, as root), and its own agent, which
enrolls with the slot's single-use bootstrap token and runs the slot's jobs as on any machine.

The exchange is level-triggered: every answer says again which slots to start and which to stop
until this host's report shows it done, so a lost answer or a crash here loses nothing. Slots
outlive this process (each is a session of its own): a restarted host agent finds them in
``--slots-dir`` and reports them again; its service unit should leave them running
(systemd ``KillMode=process``), so an upgrade of the host agent ends no job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from catacloud.agent import __version__
from catacloud.agent.client import AgentAPIError, AgentClient, Interrupted, Unauthorized, register_secret
from catacloud.protocol import HostAnswer, HostCapacity, HostReport, SlotStart

log = logging.getLogger("catacloud.agent")

GPU_GLOB = "/dev/nvidia[0-9]*"
# The exit status of a revoked host's agent: its service is not restarted for it
# (RestartPreventExitStatus in the unit install-host.sh writes).
EXIT_REVOKED = 4


@dataclass(frozen=True)
class Offer:
    """What this host offers; ``None``: all it has."""

    cpus: int | None = None
    memory_mb: int | None = None
    disk_gb: int | None = None
    gpus: int | None = None


def capacity(slots_dir: str, offer: Offer, reserve_gb: float) -> HostCapacity:
    """What this host has (or offers): its cpus, memory, the free disk where slots live (less
    the reserve it keeps), GPUs it can see, its architecture."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    memory_mb = psutil.virtual_memory().total // 2**20
    st = os.statvfs(slots_dir)
    disk_gb = max(0, int(st.f_bavail * st.f_frsize / 10**9 - reserve_gb))
    gpus = len(list(Path("/dev").glob(GPU_GLOB[len("/dev/") :])))
    return HostCapacity(
        cpus=min(cpus, offer.cpus) if offer.cpus else cpus,
        memory_mb=min(memory_mb, offer.memory_mb) if offer.memory_mb else memory_mb,
        disk_gb=min(disk_gb, offer.disk_gb) if offer.disk_gb is not None else disk_gb,
        gpus=min(gpus, offer.gpus) if offer.gpus is not None else gpus,
        arch=platform.machine(),
    )


class HostAgent:
    """Enroll (or resume), then exchange reports for orders until told to stop."""

    def __init__(
        self,
        client: AgentClient,
        *,
        url: str,
        enrolment_token: str,
        state_file: str,
        slots_dir: str,
        offer: Offer = Offer(),
        hostname: str | None = None,
        provider_config: dict[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.url = url
        self.enrolment_token = enrolment_token
        self.state_file = state_file
        self.slots_dir = slots_dir
        self.offer = offer
        self.hostname = hostname or socket.gethostname()
        self.stopping = threading.Event()
        os.makedirs(slots_dir, mode=0o711, exist_ok=True)
        from catacloud.providers.local import LocalProvider

        self.provider = LocalProvider(
            config={"state_dir": slots_dir, **(provider_config or {})}, credentials={}
        )
        self.poll_timeout = 20.0
        # Slots being started now (reported as running meanwhile: not started twice), and being
        # stopped now (reported while they still exist, not ordered to stop twice).
        self._starting: set[str] = set()
        self._stopping: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="slot")

    def request_stop(self) -> None:
        self.stopping.set()

    # -- enrolment --------------------------------------------------------------------------

    def _enrolled(self) -> bool:
        """The saved credential, or a new enrolment (saved); False when refused."""
        with contextlib.suppress(OSError, ValueError, KeyError):
            saved = json.loads(Path(self.state_file).read_text())
            self.client.set_token(saved["host_token"])
            log.info("host %s: resuming its enrolment", saved["host_id"])
            return True
        if not self.enrolment_token:
            log.error("no enrolment token and no saved enrolment (%s)", self.state_file)
            return False
        try:
            answer = self.client.host_enroll(
                enrolment_token=self.enrolment_token,
                hostname=self.hostname,
                capacity=self._capacity(),
                agent_version=__version__,
                interrupt=self.stopping,
            )
        except (AgentAPIError, Interrupted) as exc:
            log.error("could not enroll this host: %s", exc)
            return False
        os.makedirs(os.path.dirname(os.path.abspath(self.state_file)), mode=0o700, exist_ok=True)
        fd = os.open(self.state_file + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"host_id": answer.host_id, "host_token": answer.host_token}, fh)
        os.replace(self.state_file + ".tmp", self.state_file)
        self.poll_timeout = answer.poll_timeout
        log.info("enrolled as host %s", answer.host_id)
        return True

    def _capacity(self) -> HostCapacity:
        return capacity(self.slots_dir, self.offer, self.provider.disk_reserve_gb)

    # -- the exchange -----------------------------------------------------------------------

    def run(self) -> int:
        """Until told to stop (or revoked: :data:`EXIT_REVOKED`, which its service does not restart)."""
        if not self._enrolled():
            return 2
        while not self.stopping.is_set():
            report = HostReport(running=tuple(self._running()), capacity=self._capacity())
            try:
                answer = self.client.host_exchange(report, wait=self.poll_timeout, interrupt=self.stopping)
            except Interrupted:
                break
            except Unauthorized:
                log.error("the control plane refused this host's credential (revoked): ending its slots")
                self._stop_all()
                return EXIT_REVOKED
            except AgentAPIError as exc:
                log.warning("exchange failed: %s", exc)
                self.stopping.wait(2.0)
                continue
            if not self._follow(answer):  # the same orders again while they are carried out:
                self.stopping.wait(0.5)  # ask again in a moment, not in a tight loop
        self._pool.shutdown(wait=True)
        return 0

    def _running(self) -> list[str]:
        """The slots that exist here, and those being started. A slot being stopped is reported
        only while it still exists: reported after, it would be ordered to stop again, and that
        stop would report it again, for ever (the host's room never freed)."""
        with self._lock:
            starting = set(self._starting)
        return sorted({m.provider_id for m in self.provider.list({})} | starting)

    def _follow(self, answer: HostAnswer) -> bool:
        """Carry out the answer's orders; False when each was being carried out already."""
        acted = [self._act(slot.instance_id, self._start, slot, self._starting) for slot in answer.start]
        acted += [self._act(i, self.provider.delete, i, self._stopping) for i in answer.stop]
        return any(acted) or not acted

    def _act(self, slot_id: str, action: Any, arg: Any, busy: set[str]) -> bool:
        """Start or stop a slot in the background (a stop waits for its agent to end), once: an
        order repeated while it is carried out is left alone (False)."""
        with self._lock:
            if slot_id in self._starting or slot_id in self._stopping:
                return False
            busy.add(slot_id)

        def run() -> None:
            try:
                action(arg)
            except Exception as exc:  # a slot that cannot start: its row's deadline ends it
                log.warning("slot %s: %s", slot_id, exc)
            finally:
                with self._lock:
                    busy.discard(slot_id)

        self._pool.submit(run)
        return True

    def _start(self, slot: SlotStart) -> None:
        from catacloud.providers.base import Bootstrap, MachineSpec

        register_secret(slot.bootstrap_token)
        spec = MachineSpec(
            instance_id=slot.instance_id,
            labels=dict(slot.labels),
            server_type="slot",
            image="",
            cpus=slot.cpus,
            memory_mb=slot.memory_mb,
            gpus=slot.gpus,
            disk_gb=slot.disk_gb,
            bootstrap=Bootstrap(agent_url=self.url, token=slot.bootstrap_token),
        )
        self.provider.create(spec)
        log.info("slot %s started (%d cpus, %d MB)", slot.instance_id, slot.cpus, slot.memory_mb)

    def _stop_all(self) -> None:
        for machine in self.provider.list({}):
            with contextlib.suppress(Exception):
                self.provider.delete(machine.provider_id)
