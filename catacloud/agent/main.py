"""The agent: one enrolled machine (``catacloud agent``; its command line is
:mod:`catacloud.agent.command`, running a job :mod:`catacloud.agent.jobrun`).

Threads: the main thread enrolls, then waits for a reason to stop (signal, ``terminate``, a 401,
with ``--exit-when-unreachable`` a control plane silent for too long);
a heartbeat thread; a work thread that long-polls and runs one job at a time (restore its
checkpoint, run it, report it, upload its outputs); the job socket server (job-meta and
checkpoint requests); with ``interval_seconds``, a checkpointer thread per job; and, with
``--imds-url``, the spot watcher (EC2's, or with ``--imds-kind azure`` Azure's Scheduled Events;
it saves the checkpoint before reporting the notice).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

from catacloud.agent import __version__
from catacloud.agent.backoff import heartbeat_delay
from catacloud.agent.client import (
    AgentAPIError,
    AgentClient,
    Enrollment,
    Interrupted,
    Unauthorized,
    Unavailable,
    redact,
    register_secret,
)
from catacloud.agent.disk import Area, job_area
from catacloud.agent.enrolment import load_enrollment, machine_report, read_limits, save_enrollment
from catacloud.agent.files import (
    CheckpointError,
)
from catacloud.agent.imagejob import JobImages, image_dir_for
from catacloud.agent.imds import NOTICE_GRACE_SECONDS, spot_watcher
from catacloud.agent.jobrun import (
    INTERRUPTION_GRACE_SECONDS,
    REASON_AGENT_STOPPED,
    REASON_CANCELLED,
    REASON_INTERRUPTED,
    REASON_TERMINATING,
    CurrentJob,
    JobRunning,
)
from catacloud.agent.meta import MetaServer
from catacloud.agent.netns import Allow
from catacloud.agent.registry_proxy import RegistryProxy
from catacloud.agent.sandbox import (
    Launcher,
    UidAllocator,
    UidLauncher,
    UidRange,
)
from catacloud.agent.workplace import choose_launcher, prepare_site
from catacloud.protocol import AgentError, ImagesReport

log = logging.getLogger("catacloud.agent")

# The exit status of an agent that gave up on an unreachable control plane.
EXIT_UNREACHABLE = 3


class Agent(JobRunning):
    """One enrolled machine: heartbeats, runs jobs, serves job-meta, watches for interruption."""

    def __init__(
        self,
        client: AgentClient,
        *,
        bootstrap_token: str,
        work_dir: str | None = None,
        heartbeat_interval: float | None = None,
        imds_url: str | None = None,
        imds_kind: str = "ec2",
        hostname: str | None = None,
        state_file: str | None = None,
        job_uids: UidRange | None = None,
        bootstrap_token_file: str | None = None,
        limits_file: str | None = None,
        sandbox: bool = True,
        shared_dirs: tuple[str, ...] = (),
        network: bool = True,
        network_ahead: bool = True,
        disk_reserve_bytes: int = 0,
        disk_limit_bytes: int | None = None,
        unreachable_limit: float | None = None,
        image_dir: str | None = None,
        insecure_registries: tuple[str, ...] = (),
    ) -> None:
        self.client = client
        # The machine's image store (catacloud/agent/images.py): beside the work root unless given.
        self.image_dir = image_dir
        self.insecure_registries = insecure_registries
        self.registry_proxy = RegistryProxy()  # listens once a containers job has registry logins
        self.images: JobImages | None = None
        # Seconds without reaching the control plane after which this agent ends (None: never).
        self.unreachable_limit = unreachable_limit
        self.bootstrap_token = bootstrap_token
        self.bootstrap_token_file = bootstrap_token_file
        # Root: each job runs as the next uid of this range. None: as this agent's own uid
        # (in a user namespace of its own when sandboxed).
        self.job_uids = UidAllocator(job_uids) if job_uids is not None else None
        self.limits_file = limits_file
        self.sandbox = sandbox
        self.network = network  # False: jobs get a namespace with a loopback only
        self.network_ahead = network_ahead  # the next job's network made while this machine idles
        self.disk_reserve_bytes = disk_reserve_bytes  # a job ends before the disk's free space does
        self.disk_limit_bytes = disk_limit_bytes  # the machine type's disk_gb: the jobs' area's size
        self.area: Area | None = None  # the jobs' file system of fixed size (catacloud/agent/disk.py)
        self.area_baseline = 0  # what the area holds of the agent's own (its job bin, its socket)
        self.disk_report: dict[str, Any] = {}
        self.agent_tmp: str | None = None  # the agent's own temporary files (checkpoint archives)
        self.shared_dirs = shared_dirs
        self.launcher: Launcher = UidLauncher()
        self.state_file = state_file
        self.work_root = work_dir
        self.job_bin: str | None = None  # holds the `catacloud` wrapper jobs call
        self.heartbeat_override = heartbeat_interval
        self.imds_url = imds_url
        self.imds_kind = imds_kind  # ec2 or azure: whose interruption notices (catacloud/agent/imds.py)
        # How long a job has to write its checkpoint after a notice: what the notice leaves.
        self.interruption_grace = NOTICE_GRACE_SECONDS.get(imds_kind, INTERRUPTION_GRACE_SECONDS)
        self.hostname = hostname or socket.gethostname()
        self.stopping = threading.Event()
        self.exit_code = 0
        self.heartbeat_interval = 5.0
        self.poll_timeout = 30.0
        self.meta: MetaServer | None = None
        self._lock = threading.Lock()
        self._current: CurrentJob | None = None
        self._busy = False  # between claiming a job ("started") and reporting it ("finished")
        self._idle = threading.Condition(self._lock)
        self._stop_job_reason = REASON_AGENT_STOPPED
        self._report_on_stop = True
        self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._heartbeat_failures = 0
        self._next_uid: int | None = None
        self._ahead = False
        self._next_allow: tuple[Allow, ...] = ()

    # -- stopping ---------------------------------------------------------------------------

    def request_stop(self, job_reason: str, exit_code: int, *, report: bool = True) -> None:
        """Stop the agent: end the running job (reported with ``job_reason``) and exit."""
        with self._lock:
            if self.stopping.is_set():
                return
            self.exit_code = exit_code
            self._stop_job_reason = job_reason
            self._report_on_stop = report
            self.stopping.set()
            current = self._current
        if current is not None:
            current.cancel.cancel(job_reason)

    def _give_up_if_unreachable(self) -> None:
        """With an unreachable limit: stop (exit status 3, nothing reported: nobody would hear
        it) once no call has reached the control plane for that long."""
        silent = self.client.unreachable_for()
        if self.unreachable_limit is None or silent < self.unreachable_limit:
            return
        log.error(
            "the control plane at %s has not answered for %.0f s (limit %g s); the agent stops",
            self.client.base_url,
            silent,
            self.unreachable_limit,
        )
        self.request_stop(REASON_AGENT_STOPPED, EXIT_UNREACHABLE, report=False)

    def fatal(self, message: str) -> None:
        """An unrecoverable error (e.g. a revoked agent token): log it clearly and stop."""
        log.error("%s; the agent stops", redact(message))
        self.request_stop(REASON_AGENT_STOPPED, 1, report=False)

    # -- main -------------------------------------------------------------------------------

    def _prepare(self) -> str | None:
        """The work root, the job socket and the way jobs start; why not, when that fails."""
        sample_uid = self.job_uids.uids.start if self.job_uids is not None else None
        # The jobs' area first: the work root's own files (the job bin, the socket) live in it.
        why_not = str(read_limits(self.limits_file).get("disk_why_not", ""))
        self.area, self.disk_report = job_area(self.work_root, self.disk_limit_bytes, why_not=why_not)
        site = prepare_site(self.work_root, sample_uid)
        if isinstance(site, str):
            return site
        if self.area is not None:
            self.area_baseline = self.area.used_bytes()
        self.agent_tmp = self._private_tmp() if self.area is not None else site.work_root
        given_work_dir = self.work_root
        self.work_root, self.job_bin = site.work_root, site.job_bin
        self.meta = MetaServer(self._fetch_meta, checkpoint=self._checkpoint_now, directory=site.socket_dir)
        state_dirs = [
            os.path.dirname(os.path.abspath(p)) for p in (self.state_file, self.bootstrap_token_file) if p
        ]
        self.images = JobImages(
            self.image_dir or image_dir_for(given_work_dir),
            mount_dirs=[site.work_root, *self.shared_dirs],
            insecure_registries=self.insecure_registries,
        )
        if self.images.root is not None:
            state_dirs.append(self.images.root)  # hidden from jobs, as the agent's other folders
        if self.agent_tmp != site.work_root:
            state_dirs.append(self.agent_tmp)
        self.launcher = choose_launcher(
            site,
            sandbox=self.sandbox,
            network=self.network,
            hostname=self.hostname,
            hidden=state_dirs,
            shared=self.shared_dirs,
            sample_uid=sample_uid,
        )
        return None

    def _images_report(self) -> dict[str, str] | None:
        """Whether this machine runs images: only in the bubblewrap sandbox (imagejob.py)."""
        return self.images.describe(sandboxed=self.launcher.kind == "bubblewrap") if self.images else None

    def _private_tmp(self) -> str:
        """The agent's own temporary files beside the jobs' area, on the host's disk (a checkpoint's
        archive must not take the room its job may fill): 0700, hidden from jobs."""
        assert self.work_root is not None
        folder = self.work_root.rstrip("/") + ".tmp"
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        return folder

    def run(self) -> int:
        """Prepare the jobs' place, enroll (or reuse a saved enrollment), start the threads, wait
        until told to stop; the process exit code."""
        problem = self._prepare()
        if problem is not None:
            log.error("%s", problem)
            return 2
        assert self.meta is not None
        enrollment = self._enrollment()
        if isinstance(enrollment, int):
            self.meta.close()
            return enrollment
        self.bootstrap_token = ""
        if self.bootstrap_token_file:  # used once: it is no longer anywhere on this machine
            with contextlib.suppress(OSError):
                os.unlink(self.bootstrap_token_file)
        self.heartbeat_interval = self.heartbeat_override or enrollment.heartbeat_interval
        self.poll_timeout = enrollment.poll_timeout
        log.info(
            "enrolled as instance %s (heartbeat every %g s, long poll %g s)",
            enrollment.instance_id,
            self.heartbeat_interval,
            self.poll_timeout,
        )
        self.meta.start()
        try:
            self._prefetch_images(enrollment)  # a pool member has its images before it is ready
            self.prepare_next(wait=True)  # and its first job's network
            # the handshake: enroll + heartbeat = ready
            self._heartbeat_once(retry_for=min(60.0, self.unreachable_limit or 60.0))
            threads = [
                threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
                threading.Thread(target=self._work_loop, name="work", daemon=True),
            ]
            for thread in threads:
                thread.start()
            if self.imds_url:
                report = self._report_interruption
                spot_watcher(self.imds_kind, self.imds_url, report, stop=self.stopping).start()
            while not self.stopping.wait(0.5):
                self._give_up_if_unreachable()
            self._wait_idle(timeout=30.0)
        finally:
            self.launcher.discard_network()
            self.registry_proxy.close()
            self.meta.close()
        log.info("agent stopped (exit code %d)", self.exit_code)
        return self.exit_code

    def _enrollment(self) -> Enrollment | int:
        """The saved enrollment, or a new one (saved); an exit status when enrolling fails."""
        enrollment = load_enrollment(self.state_file)
        if enrollment is not None:
            register_secret(enrollment.agent_token)
            self.client.set_token(enrollment.agent_token)
            log.info("reusing the saved enrollment of instance %s", enrollment.instance_id)
            return enrollment
        try:
            enrollment = self.client.enroll(
                bootstrap_token=self.bootstrap_token,
                hostname=self.hostname,
                agent_version=__version__,
                machine=machine_report(
                    self.launcher,
                    self.job_uids.uids if self.job_uids else None,
                    self.limits_file,
                    self.images.describe(sandboxed=self.launcher.kind == "bubblewrap")
                    if self.images
                    else None,
                    self.disk_report,
                ),
                retry_for=self.unreachable_limit or 600.0,
                interrupt=self.stopping,
            )
        except Interrupted:
            return self.exit_code
        except Unavailable as exc:
            if self.unreachable_limit is None:
                log.error("could not enroll with %s: %s", self.client.base_url, exc)
                return 1
            log.error(
                "the control plane at %s did not answer within %g s (the unreachable limit); "
                "the agent stops: %s",
                self.client.base_url,
                self.unreachable_limit,
                exc,
            )
            return EXIT_UNREACHABLE
        except AgentAPIError as exc:
            log.error("could not enroll with %s: %s", self.client.base_url, exc)
            return 1
        save_enrollment(self.state_file, enrollment)
        return enrollment

    def _prefetch_images(self, enrollment: Any) -> None:
        """The machine type's image budget; a pool's images pulled, and reported, before the
        handshake heartbeat that makes this member ready."""
        if self.images is None:
            return
        self.images.set_budget(enrollment.image_store_bytes)
        if not enrollment.images:
            return
        pulls = self.images.prefetch(enrollment.images, self.stopping)
        try:
            self.client.report_images(ImagesReport(pulls=pulls, held=self.images.held()))
        except AgentAPIError as exc:
            if isinstance(exc, Unauthorized):
                raise
            log.warning("could not report the pool's images: %s", exc)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("giving up waiting for the job report")
                    return
                self._idle.wait(remaining)

    # -- heartbeats -------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        next_at = time.monotonic() + self.heartbeat_interval
        while not self.stopping.wait(max(0.0, next_at - time.monotonic())):
            next_at = max(next_at + heartbeat_delay(self.heartbeat_interval), time.monotonic())
            self._heartbeat_once()

    def _heartbeat_once(self, retry_for: float = 0.0) -> None:
        with self._lock:
            current = self._current
        try:
            cancel_ids, terminate = self.client.heartbeat(
                current.job.id if current else None, retry_for=retry_for, interrupt=self.stopping
            )
        except Unauthorized as exc:
            self.fatal(f"the control plane rejected this agent's credentials ({exc})")
            return
        except AgentAPIError as exc:
            self._heartbeat_failures += 1
            if self._heartbeat_failures in (1, 3) or self._heartbeat_failures % 20 == 0:
                log.warning("heartbeat failed (%d in a row): %s", self._heartbeat_failures, exc)
            return
        if self._heartbeat_failures:
            log.info("heartbeats are getting through again")
            self._heartbeat_failures = 0
        for job_id in cancel_ids:
            self._cancel_job(job_id, REASON_CANCELLED)
        if terminate:
            log.info("the control plane is terminating this machine")
            self.request_stop(REASON_TERMINATING, 0)

    def _cancel_job(self, job_id: str, reason: str) -> None:
        with self._lock:
            self._cancelled[job_id] = None
            while len(self._cancelled) > 256:
                self._cancelled.popitem(last=False)
            current = self._current
        if current is not None and current.job.id == job_id and current.cancel.cancel(reason):
            log.info("job %s: cancellation requested", job_id)

    def _fetch_meta(self, job_id: str, name: str) -> tuple[int, dict[str, Any]]:
        try:
            return self.client.job_meta(job_id, name)
        except Unauthorized as exc:
            self.fatal(f"the control plane rejected this agent's credentials ({exc})")
            raise

    # -- spot interruption ------------------------------------------------------------------

    def _report_interruption(self, detail: str) -> None:
        """A spot interruption notice. A running job is told first: SIGTERM, and
        ``interruption_grace`` s to write its checkpoint directory (a trap that writes its
        state, ``catacloud checkpoint``) before SIGKILL; its run then saves the checkpoint if it
        changed and reports the interruption instead of an outcome (the control plane requeues
        the job on it). With no job running, the interruption is reported at once."""
        with self._lock:
            current = self._current
            told = (
                current is not None
                and not current.cancel.is_set()
                and current.cancel.cancel(REASON_INTERRUPTED, grace=self.interruption_grace)
            )
            if told and current is not None:
                current.interrupted = detail
        if told and current is not None:
            log.warning(
                "job %s: spot interruption: SIGTERM now, SIGKILL after %.0f s; its checkpoint follows",
                current.job.id,
                self.interruption_grace,
            )
            return
        checkpointer = current.checkpointer if current is not None else None
        if current is not None and checkpointer is not None:  # a job ending for another reason
            try:
                self._save_before_interruption(current.job, checkpointer)
            except Unauthorized as exc:
                self.fatal(f"the control plane rejected this agent's credentials ({exc})")
                return
        self._report_interruption_now(detail)

    def _report_interruption_now(self, detail: str) -> None:
        try:
            self.client.interruption("spot", detail, retry_for=90.0)  # the notice gives two minutes
        except Unauthorized as exc:
            self.fatal(f"the control plane rejected this agent's credentials ({exc})")
            return
        except AgentAPIError as exc:  # never a job's failure: the reconciler finds the machine gone
            log.error("could not report the spot interruption: %s", exc)
            return
        log.info("reported the spot interruption to the control plane")

    # -- jobs -------------------------------------------------------------------------------

    def _work_loop(self) -> None:
        failures = 0
        try:
            while not self.stopping.is_set():
                try:
                    job = self.client.poll_work(self.poll_timeout, interrupt=self.stopping)
                except Interrupted:
                    return
                except AgentAPIError as exc:  # an answer we do not understand: slow down
                    if isinstance(exc, Unauthorized):
                        raise
                    log.warning("polling for work failed: %s", exc)
                    self.stopping.wait(self.client.backoff(failures))
                    failures += 1
                    continue
                failures = 0
                received = time.monotonic()
                if job is None:
                    continue
                with self._lock:
                    if self.stopping.is_set():
                        log.info("job %s: not starting it, the agent is stopping", job.id)
                        return
                    self._busy = True
                try:
                    self._run_job(job, received)
                except Unauthorized:
                    raise
                except Exception as exc:
                    log.exception("job %s: internal agent error", job.id)
                    self._report_crash(job, exc)
                finally:
                    with self._idle:
                        self._current = None
                        self._busy = False
                        self._idle.notify_all()
                self.prepare_next()
        except Unauthorized as exc:
            self.fatal(f"the control plane rejected this agent's credentials ({exc})")
        except Exception:
            log.exception("the work loop crashed")
            self.fatal("internal error in the work loop")

    # -- checkpoints and outputs ------------------------------------------------------------

    def _checkpoint_now(self, job_id: str) -> tuple[int, dict[str, Any]]:
        """``catacloud checkpoint`` from the job: save, and answer once stored."""
        with self._lock:
            current = self._current
        checkpointer = current.checkpointer if current and current.job.id == job_id else None
        if checkpointer is None:
            return 409, {"code": AgentError.JOB_NOT_RUNNING, "detail": "the job is no longer running"}
        try:
            answer = checkpointer.save("requested by the job", only_if_changed=False)
        except CheckpointError as exc:
            return exc.status, {"code": exc.code, "detail": f"checkpoint not saved: {exc}"}
        except Unauthorized as exc:
            self.fatal(f"the control plane rejected this agent's credentials ({exc})")
            return 502, {"code": AgentError.CHECKPOINT_FAILED, "detail": "the agent lost its credentials"}
        except Exception as exc:
            log.exception("job %s: checkpoint failed", job_id)
            return 500, {"code": AgentError.CHECKPOINT_FAILED, "detail": f"agent error: {type(exc).__name__}"}
        answer = answer or {}
        return 200, {"size": answer.get("size"), "sha256": answer.get("sha256")}
