"""The ``catacloud agent``, ``catacloud job-meta`` and ``catacloud checkpoint`` commands.

Threads: the main thread enrolls, then waits for a reason to stop (signal, ``terminate``, a 401,
with ``--exit-when-unreachable`` a control plane silent for too long);
a heartbeat thread; a work thread that long-polls and runs one job at a time (restore its
checkpoint, run it, report it, upload its outputs); the job socket server (job-meta and
checkpoint requests); with ``interval_seconds``, a checkpointer thread per job; and, with
``--imds-url``, the spot watcher (which saves the checkpoint before reporting the notice).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from catacloud.agent import __version__
from catacloud.agent.backoff import heartbeat_delay
from catacloud.agent.client import (
    AgentAPIError,
    AgentClient,
    Interrupted,
    Job,
    RedactingFormatter,
    Unauthorized,
    Unavailable,
    allow_list,
    forget_secret,
    redact,
    register_secret,
)
from catacloud.agent.disk import DiskWatch
from catacloud.agent.enrolment import load_enrollment, machine_report, save_enrollment
from catacloud.agent.files import (
    CHECKPOINT_ENV,
    OUTPUT_ENV,
    Checkpointer,
    CheckpointError,
    checkpoint_command,
    list_outputs,
)
from catacloud.agent.imagejob import JobImages, image_cwd, image_dir_for, image_process
from catacloud.agent.images import ImageError, PullCancelled, Pulled
from catacloud.agent.imds import SpotWatcher
from catacloud.agent.meta import SOCKET_ENV, TOKEN_ENV, MetaServer, job_meta_command
from catacloud.agent.outputs import (
    FINISHED_RETRY_SECONDS,
    STOPPING_RETRY_SECONDS,
    restore_checkpoint,
    upload_outputs,
)
from catacloud.agent.runner import Cancellation, JobResult, LogStreamer, run_job_process
from catacloud.agent.sandbox import (
    DEFAULT_JOB_UIDS,
    SANDBOX_SOCKET,
    ImageRoot,
    JobPlace,
    Launcher,
    UidAllocator,
    UidLauncher,
    UidRange,
    can_switch_to,
    make_undumpable,
)
from catacloud.agent.workplace import choose_launcher, give, prepare_site
from catacloud.protocol import AgentError, ImagePulled, ImagesReport, Outcome

log = logging.getLogger("catacloud.agent")

BOOTSTRAP_ENV = "CATACLOUD_BOOTSTRAP_TOKEN"
REASON_CANCELLED = "cancelled by the control plane"
REASON_TERMINATING = "machine terminating"
REASON_AGENT_STOPPED = "agent stopped"
# The exit status of an agent that gave up on an unreachable control plane.
EXIT_UNREACHABLE = 3


@dataclass
class CurrentJob:
    """The job this machine runs now."""

    job: Job
    cancel: Cancellation
    checkpointer: Checkpointer | None = None  # while its command runs


class Agent:
    """One enrolled machine: heartbeats, runs jobs, serves job-meta, watches for interruption."""

    def __init__(
        self,
        client: AgentClient,
        *,
        bootstrap_token: str,
        work_dir: str | None = None,
        heartbeat_interval: float | None = None,
        imds_url: str | None = None,
        hostname: str | None = None,
        state_file: str | None = None,
        job_uids: UidRange | None = None,
        bootstrap_token_file: str | None = None,
        limits_file: str | None = None,
        sandbox: bool = True,
        shared_dirs: tuple[str, ...] = (),
        network: bool = True,
        disk_reserve_bytes: int = 0,
        unreachable_limit: float | None = None,
        image_dir: str | None = None,
        insecure_registries: tuple[str, ...] = (),
    ) -> None:
        self.client = client
        # The machine's image store (catacloud/agent/images.py): beside the work root unless given.
        self.image_dir = image_dir
        self.insecure_registries = insecure_registries
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
        self.disk_reserve_bytes = disk_reserve_bytes  # a job ends before the disk's free space does
        self.shared_dirs = shared_dirs
        self.launcher: Launcher = UidLauncher()
        self.state_file = state_file
        self.work_root = work_dir
        self.job_bin: str | None = None  # holds the `catacloud` wrapper jobs call
        self.heartbeat_override = heartbeat_interval
        self.imds_url = imds_url
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
        site = prepare_site(self.work_root, sample_uid)
        if isinstance(site, str):
            return site
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

    def run(self) -> int:
        """Prepare the jobs' place, enroll (or reuse a saved enrollment), start the threads, wait
        until told to stop; the process exit code."""
        problem = self._prepare()
        if problem is not None:
            log.error("%s", problem)
            return 2
        assert self.meta is not None
        enrollment = load_enrollment(self.state_file)
        if enrollment is not None:
            register_secret(enrollment.agent_token)
            self.client.set_token(enrollment.agent_token)
        if enrollment is not None:
            log.info("reusing the saved enrollment of instance %s", enrollment.instance_id)
        else:
            try:
                enrollment = self.client.enroll(
                    bootstrap_token=self.bootstrap_token,
                    hostname=self.hostname,
                    agent_version=__version__,
                    machine=machine_report(
                        self.launcher,
                        self.job_uids.uids if self.job_uids else None,
                        self.limits_file,
                        self.images.describe() if self.images else None,
                    ),
                    retry_for=self.unreachable_limit or 600.0,
                    interrupt=self.stopping,
                )
            except Interrupted:
                self.meta.close()
                return self.exit_code
            except Unavailable as exc:
                self.meta.close()
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
                self.meta.close()
                return 1
            save_enrollment(self.state_file, enrollment)
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
            # the handshake: enroll + heartbeat = ready
            self._heartbeat_once(retry_for=min(60.0, self.unreachable_limit or 60.0))
            threads = [
                threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
                threading.Thread(target=self._work_loop, name="work", daemon=True),
            ]
            for thread in threads:
                thread.start()
            if self.imds_url:
                SpotWatcher(self.imds_url, self._report_interruption, stop=self.stopping).start()
            while not self.stopping.wait(0.5):
                self._give_up_if_unreachable()
            self._wait_idle(timeout=30.0)
        finally:
            self.meta.close()
        log.info("agent stopped (exit code %d)", self.exit_code)
        return self.exit_code

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
        """Save the running job's checkpoint (if it changed), then report the interruption: the
        control plane requeues the job on that report and would refuse a later checkpoint."""
        with self._lock:
            checkpointer = self._current.checkpointer if self._current else None
        if checkpointer is not None:
            try:
                checkpointer.save("spot interruption", only_if_changed=True)
            except Unauthorized as exc:
                self.fatal(f"the control plane rejected this agent's credentials ({exc})")
                return
            except Exception as exc:  # whatever happens, the interruption must still be reported
                log.warning("job %s: no checkpoint before the interruption: %s", checkpointer.job_id, exc)
        try:
            self.client.interruption("spot", detail)
        except Unauthorized as exc:
            self.fatal(f"the control plane rejected this agent's credentials ({exc})")
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
                if job is None:
                    continue
                with self._lock:
                    if self.stopping.is_set():
                        log.info("job %s: not starting it, the agent is stopping", job.id)
                        return
                    self._busy = True
                try:
                    self._run_job(job)
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
        except Unauthorized as exc:
            self.fatal(f"the control plane rejected this agent's credentials ({exc})")
        except Exception:
            log.exception("the work loop crashed")
            self.fatal("internal error in the work loop")

    def _report_crash(self, job: Job, exc: Exception) -> None:
        """Best effort after an agent bug: stop what the job left and report it failed."""
        with self._lock:
            current = self._current
        if current is None or current.job.id != job.id:
            return  # it never started
        try:
            self.client.job_finished(
                job.id,
                exit_code=None,
                outcome=Outcome.FAILED,
                reason=f"agent error: {type(exc).__name__}",
                retry_for=STOPPING_RETRY_SECONDS,
            )
            self.client.uploads_done(job.id, [], retry_for=STOPPING_RETRY_SECONDS)
        except AgentAPIError as report_exc:
            log.error("job %s: could not report its outcome: %s", job.id, report_exc)

    def _job_dir(self, job: Job, uid: int | None) -> str:
        assert self.work_root is not None
        safe_id = re.sub(r"[^A-Za-z0-9_.-]", "_", job.id)[:128]
        path = os.path.join(self.work_root, f"{safe_id}-{job.attempt}")
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
        os.mkdir(path, 0o700)
        give(path, uid)
        return path

    def _job_env(
        self, job: Job, work_dir: str, token: str, socket_path: str, image_env: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The job's whole environment: a sane base, (inside an image) the image's ``Env``, its
        own env, then ``CATACLOUD_*``.

        Nothing of the agent's own environment is passed on (on the local provider that is the
        control plane's: database and broker URLs, keys, passwords)."""
        # ``catacloud`` (job-meta, checkpoint) first: the agent's own wrapper, whatever the install
        # (not inside an image: the agent's Python is not there).
        bin_dirs = [d for d in (self.job_bin, os.path.dirname(sys.executable)) if d and image_env is None]
        user = "catacloud-job" if self.launcher.kind == "bubblewrap" else os.environ.get("USER", "")
        if self.job_uids is not None and self.launcher.kind != "bubblewrap":
            user = ""  # a uid with no name on this machine
        env = {
            "PATH": ":".join([*bin_dirs, "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]),
            "HOME": work_dir,
            "LANG": "C.UTF-8",
            "TMPDIR": work_dir,
            "USER": user,
            "LOGNAME": user,
        }
        env.update(image_env or {})
        env.update(job.env)
        env.update(
            {
                "CATACLOUD_JOB_ID": job.id,
                "CATACLOUD_ATTEMPT": str(job.attempt),
                "CATACLOUD_WORK_DIR": work_dir,
                OUTPUT_ENV: os.path.join(work_dir, "output"),
                CHECKPOINT_ENV: os.path.join(work_dir, "checkpoint"),
                SOCKET_ENV: socket_path,
                TOKEN_ENV: token,
            }
        )
        return env

    def _send_logs(self, job_id: str, chunks: list[dict[str, Any]]) -> bool:
        try:
            return self.client.send_logs(job_id, chunks)
        except Unauthorized as exc:
            self.fatal(f"the control plane rejected this agent's credentials ({exc})")
            raise

    def _run_job(self, job: Job) -> None:
        """Claim the job's start, run it in its folder, report it, upload its outputs."""
        if not self._claim_start(job):
            return
        started = time.monotonic()  # the job's timeout counts from here, its image's pull included
        cancel = Cancellation()
        token = secrets.token_urlsafe(32)
        register_secret(token)
        for value in job.secret_values:
            register_secret(value)  # never in the agent's own log either
        with self._lock:
            self._current = CurrentJob(job, cancel)
            if job.id in self._cancelled:
                cancel.cancel(REASON_CANCELLED)
            if self.stopping.is_set():
                cancel.cancel(self._stop_job_reason)
        streamer = LogStreamer(
            lambda chunks: self._send_logs(job.id, chunks),
            on_cancel=lambda: self._cancel_job(job.id, REASON_CANCELLED),
        )
        streamer.start()
        work_dir: str | None = None
        uid = self.job_uids.take() if self.job_uids is not None else None
        try:
            work_dir = self._job_dir(job, uid)
            for folder in ("output", "checkpoint"):
                os.mkdir(os.path.join(work_dir, folder), 0o700)
                give(os.path.join(work_dir, folder), uid)
        except OSError as exc:
            result = JobResult(None, Outcome.FAILED, f"could not create the working directory: {exc}")
        else:
            try:
                result = self._execute(job, work_dir, uid, token, cancel, streamer, started)
            finally:
                forget_secret(token)
                for value in job.secret_values:
                    forget_secret(value)
        self._report(job, result, streamer, work_dir)

    def _claim_start(self, job: Job) -> bool:
        """Tell the control plane the job starts; False: it is not (or no longer) this machine's."""
        log.info("job %s (attempt %d) assigned", job.id, job.attempt)
        try:
            if not self.client.job_started(job.id, interrupt=self.stopping):
                log.info("job %s is no longer this machine's (409); not running it", job.id)
                return False
        except Interrupted:
            return False
        except AgentAPIError as exc:
            if isinstance(exc, Unauthorized):
                raise
            log.warning("job %s: could not confirm its start (%s); not running it", job.id, exc)
            return False
        return True

    def _execute(
        self,
        job: Job,
        work_dir: str,
        uid: int | None,
        token: str,
        cancel: Cancellation,
        streamer: LogStreamer,
        started: float,
    ) -> JobResult:
        """Have the job's image when it names one (pulled, or from the machine's store), then
        run its command (:meth:`_run_command`)."""
        if job.image is None:
            return self._run_command(job, work_dir, uid, token, cancel, streamer, started, None)
        got = self._have_image(job, cancel, started)
        if isinstance(got, JobResult):
            return got
        assert self.images is not None and self.images.store is not None
        with self.images.store.pinned(got.image.digest):  # no eviction while it runs
            return self._run_command(job, work_dir, uid, token, cancel, streamer, started, got)

    def _have_image(self, job: Job, cancel: Cancellation, started: float) -> Pulled | JobResult:
        """The job's image, reported to the control plane (its digest, whether it was pulled);
        or the job's end: a code at once for an image it cannot have, cancelled when asked."""
        assert self.images is not None and job.image is not None
        try:
            sandboxed = self.launcher.kind == "bubblewrap"
            got = self.images.for_job(job, cancel=cancel, started=started, sandboxed=sandboxed)
            image_process(got.image, job.command)  # it names a process to run
        except ImageError as exc:
            log.warning("job %s: image %s: %s (%s)", job.id, job.image.reference, exc.detail, exc.code)
            return JobResult(None, Outcome.FAILED, exc.detail, code=exc.code)
        except PullCancelled:
            return JobResult(None, Outcome.CANCELLED, cancel.reason or REASON_CANCELLED)
        log.info(
            "job %s: image %s is %s (%s)",
            job.id,
            job.image.reference,
            f"pulled: {got.bytes / 1e6:.1f} MB in {got.seconds:.2f} s" if got.pulled else "on this machine",
            got.image.digest,
        )
        pulled = ImagePulled(
            reference=job.image.reference,
            digest=got.image.digest,
            pulled=got.pulled,
            bytes=got.bytes,
            seconds=round(got.seconds, 3),
        )
        try:
            self.client.report_images(ImagesReport(pulls=(pulled,), held=self.images.held()), job_id=job.id)
        except AgentAPIError as exc:
            if isinstance(exc, Unauthorized):
                raise
            log.warning("job %s: could not report its image: %s", job.id, exc)
        return got

    def _run_command(
        self,
        job: Job,
        work_dir: str,
        uid: int | None,
        token: str,
        cancel: Cancellation,
        streamer: LogStreamer,
        started: float,
        image: Pulled | None,
    ) -> JobResult:
        """Restore the job's checkpoint, then run its command (inside its image, when it has one)
        with the checkpointer and the job socket serving it, to its end."""
        assert self.meta is not None and self.work_root is not None
        timeout = float(job.timeout_seconds)
        if timeout and image is not None:  # what the image's pull left of the job's time
            timeout -= time.monotonic() - started
            if timeout <= 0:
                return JobResult(
                    None, Outcome.TIMED_OUT, f"timed out after {job.timeout_seconds} s (its image's pull)"
                )
        checkpoint_dir = os.path.join(work_dir, "checkpoint")
        checkpointer = Checkpointer(
            job.id,
            checkpoint_dir,
            lambda archive, interrupt: self.client.put_checkpoint(job.id, archive, interrupt=interrupt),
            tmp_dir=self.work_root,
            interval=job.checkpoint.interval_seconds,
        )
        if job.checkpoint.available and not cancel.is_set():
            restore_checkpoint(self.client, job, checkpoint_dir, cancel, tmp_dir=self.work_root)
            give(checkpoint_dir, uid)
            checkpointer.mark_saved()
        self.meta.grant(job.id, token, uid=uid)
        with self._lock:
            if self._current is not None:
                self._current.checkpointer = checkpointer
        checkpointer.start()
        log.info("job %s: running in %s", job.id, work_dir)
        try:
            allow = allow_list(job.network.allow)
            root = None
            if image is not None:
                root = ImageRoot(
                    rootfs=image.image.rootfs,
                    args=image_process(image.image, job.command),
                    cwd=image_cwd(image.image, work_dir),
                    mount_root=self.work_root,
                )
            place = JobPlace(
                work_dir=work_dir, socket_path=self.meta.path, uid=uid, gid=uid, allow=allow, image=root
            )
            socket_env = SANDBOX_SOCKET if self.launcher.kind == "bubblewrap" else self.meta.path
            image_env = image.image.config.env_map() if image is not None else None
            return run_job_process(
                job.command,
                env=self._job_env(job, work_dir, token, socket_env, image_env),
                place=place,
                launcher=self.launcher,
                timeout_seconds=timeout,
                cancel=cancel,
                streamer=streamer,
                mask=job.secret_values,
                watch=DiskWatch(work_dir, job.disk_limit_bytes, reserve_bytes=self.disk_reserve_bytes),
            )
        finally:
            self.meta.revoke()
            with self._lock:
                if self._current is not None:
                    self._current.checkpointer = None
            checkpointer.close()

    def _report(self, job: Job, result: JobResult, streamer: LogStreamer, work_dir: str | None) -> None:
        """Deliver the job's output, report its outcome, upload its output files, remove its
        folder (the next job, maybe of another uid, finds nothing of this one)."""
        if self.stopping.is_set() and not self._report_on_stop:
            streamer.close(timeout=0.0)
            log.info("job %s: %s (%s); not reported", job.id, result.outcome, result.reason)
            if work_dir is not None:
                shutil.rmtree(work_dir, ignore_errors=True)
            return
        # The job's output first, retried from the streamer's spool for as long as the report
        # itself would be (then the report goes anyway: the outcome matters more).
        retry_for = STOPPING_RETRY_SECONDS if self.stopping.is_set() else FINISHED_RETRY_SECONDS
        if not streamer.close(timeout=retry_for):
            log.warning("job %s: some output could not be delivered", job.id)
        log.info("job %s finished: %s (%s)", job.id, result.outcome, result.reason)
        outputs = list_outputs(os.path.join(work_dir, "output")) if work_dir is not None else []
        try:
            self.client.job_finished(
                job.id,
                exit_code=result.exit_code,
                outcome=result.outcome,
                reason=result.reason,
                uploads_pending=len(outputs),
                code=result.code,
                retry_for=retry_for,
            )
        except Unauthorized:
            raise
        except AgentAPIError as exc:
            log.error("job %s: could not report its outcome: %s", job.id, exc)
        with self._lock:
            self._current = None  # reported: heartbeats no longer name it, nothing left to cancel
        try:
            upload_outputs(self.client, job, outputs, stopping=self.stopping)
        finally:
            if work_dir is not None:
                shutil.rmtree(work_dir, ignore_errors=True)

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


# -- commands -----------------------------------------------------------------------------------


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be a number of at least 0")
    return value


def _move_env_token_to_a_file(args: argparse.Namespace) -> None:
    """A bootstrap token given in the environment stays readable in ``/proc/<pid>/environ``
    for the process's whole life, whatever ``os.environ`` says later. Write it to a 0600 file
    (removed once enrolled) and re-execute the agent without it; the pid stays the same."""
    token = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if not token or args.bootstrap_token or args.bootstrap_token_file:
        return
    folder = tempfile.mkdtemp(prefix="catacloud-bootstrap-")  # 0700
    path = os.path.join(folder, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    env = {key: value for key, value in os.environ.items() if key != BOOTSTRAP_ENV}
    argv = [sys.executable, "-m", "catacloud.agent", *sys.argv[1:], "--bootstrap-token-file", path]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execve(sys.executable, argv, env)


def _read_bootstrap_token(args: argparse.Namespace) -> str | None:
    if args.bootstrap_token:
        return str(args.bootstrap_token).strip()
    if args.bootstrap_token_file:
        with open(args.bootstrap_token_file, encoding="utf-8") as handle:
            return handle.read().strip()
    return os.environ.get(BOOTSTRAP_ENV, "").strip() or None


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s catacloud-agent: %(message)s"))
    for name in ("catacloud.agent", "urllib3"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
    logging.getLogger("catacloud.agent").setLevel(level)
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def cmd_agent(args: argparse.Namespace) -> int:
    """``catacloud agent``: run this machine's agent until terminated."""
    _setup_logging(args.log_level)
    _move_env_token_to_a_file(args)
    saved = bool(args.state_file and os.path.exists(args.state_file))
    try:
        token = _read_bootstrap_token(args)
    except FileNotFoundError:
        token = None  # removed after enrolling; a restart resumes from the state file
        if not saved:
            log.error("the bootstrap token file %s does not exist", args.bootstrap_token_file)
            return 2
    except OSError as exc:
        log.error("cannot read the bootstrap token file: %s", exc)
        return 2
    os.environ.pop(BOOTSTRAP_ENV, None)  # jobs must never see it
    job_uids: UidRange | None = None
    if os.geteuid() == 0:
        try:
            job_uids = UidRange.parse(args.job_uids) if args.job_uids else DEFAULT_JOB_UIDS
        except ValueError as exc:
            log.error("--job-uids: %s", exc)
            return 2
        if not can_switch_to(job_uids):
            log.info(
                "job uids %s are not mapped here; jobs run as this agent's uid in a user namespace", job_uids
            )
            job_uids = None
    elif args.job_uids:
        log.error("--job-uids: only an agent running as root can run jobs as other uids")
        return 2
    if job_uids is not None:
        log.info("jobs run as uids %s, a new one for each job (never root)", job_uids)
    else:
        log.info("jobs run as this agent's uid, each in a user namespace of its own (never root)")
        make_undumpable()  # a job of the same uid may not read this process's memory or environ
    if not token and not saved:
        log.error("no bootstrap token: pass --bootstrap-token-file PATH or set %s", BOOTSTRAP_ENV)
        return 2
    if token:
        register_secret(token)
    agent = Agent(
        AgentClient(args.url, user_agent=f"catacloud-agent/{__version__}"),
        bootstrap_token=token or "",  # none: resumed from the saved enrollment
        work_dir=args.work_dir,
        heartbeat_interval=args.heartbeat_interval,
        imds_url=args.imds_url,
        state_file=args.state_file,
        job_uids=job_uids,
        bootstrap_token_file=args.bootstrap_token_file,
        limits_file=args.limits_file,
        sandbox=not args.no_sandbox,
        shared_dirs=tuple(args.shared_dir or ()),
        network=args.network != "none",
        disk_reserve_bytes=int(args.disk_reserve_gb * 10**9),
        unreachable_limit=args.exit_when_unreachable,
        image_dir=args.image_dir,
        insecure_registries=tuple(args.insecure_registry or ()),
    )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        agent.request_stop(REASON_AGENT_STOPPED, 130 if signum == signal.SIGINT else 0)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    return agent.run()


def cmd_job_meta(args: argparse.Namespace) -> int:
    """``catacloud job-meta NAME``: metadata of a resource of the running job."""
    return job_meta_command(args.name)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """``catacloud checkpoint``: save the running job's checkpoint directory now."""
    return checkpoint_command(timeout=args.timeout)


def _agent_options(agent: argparse.ArgumentParser) -> None:
    """The options of ``catacloud agent``."""
    agent.add_argument("--url", required=True, help="control plane base URL, e.g. https://catacloud.example")
    source = agent.add_mutually_exclusive_group()
    source.add_argument(
        "--bootstrap-token",
        help="single-use enrollment token (visible in the process list: "
        f"prefer --bootstrap-token-file or ${BOOTSTRAP_ENV})",
    )
    source.add_argument("--bootstrap-token-file", metavar="PATH", help="file holding the bootstrap token")
    agent.add_argument("--work-dir", metavar="DIR", help="parent of the jobs' working directories")
    agent.add_argument(
        "--job-uids",
        metavar="START+COUNT",
        default=os.environ.get("CATACLOUD_JOB_UIDS") or None,
        help="when the agent runs as root: the uids its jobs run as, a new one for each job "
        f"(default {DEFAULT_JOB_UIDS}; env CATACLOUD_JOB_UIDS)",
    )
    agent.add_argument(
        "--no-sandbox",
        action="store_true",
        help="run jobs without a bubblewrap sandbox (still as their own uid, never root)",
    )
    agent.add_argument(
        "--network",
        choices=["internet", "none"],
        default="internet",
        help="what a sandboxed job's network reaches: the internet through pasta (default; "
        "loopback, private, link-local ranges and this host refused unless the machine type "
        "allows them), or nothing but its own loopback",
    )
    agent.add_argument(
        "--disk-reserve-gb",
        type=_non_negative_float,
        default=1.0,
        metavar="GB",
        help="end a job (disk_limit_exceeded) once the free space of the disk it writes to drops "
        "below this (default 1)",
    )
    agent.add_argument(
        "--shared-dir",
        action="append",
        metavar="DIR",
        help="a folder jobs may write besides their own work folder (repeatable; everything else "
        "of the machine is read-only to them)",
    )
    agent.add_argument(
        "--image-dir",
        metavar="DIR",
        help="the machine's image store (images jobs run in, pulled once; default: 'images' beside "
        "--work-dir, else a temporary folder)",
    )
    agent.add_argument(
        "--insecure-registry",
        action="append",
        metavar="HOST[:PORT]",
        help="a registry reached over plain HTTP (repeatable; one on this machine's loopback always is)",
    )
    agent.add_argument(
        "--limits-file",
        metavar="PATH",
        help="JSON the machine's host wrote: the resource limits it enforces on this machine "
        "(reported at enrollment)",
    )
    agent.add_argument(
        "--state-file",
        metavar="PATH",
        help="keep this machine's enrollment here (mode 0600) so a restarted agent resumes "
        "instead of enrolling again with the single-use bootstrap token",
    )
    agent.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        metavar="SECONDS",
        help="override the heartbeat interval the control plane sets",
    )
    agent.add_argument(
        "--exit-when-unreachable",
        type=_positive_float,
        metavar="SECONDS",
        help="stop (exit status 3) once no call has reached the control plane for this long "
        "(default: keep trying; local machines get 600 s, their provider's unreachable_limit_seconds)",
    )
    agent.add_argument(
        "--imds-url", metavar="URL", help="watch for spot interruptions (on AWS: http://169.254.169.254)"
    )
    agent.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )


def add_agent_commands(subparsers: Any) -> None:
    """Register ``agent``, ``job-meta`` and ``checkpoint`` on an ``add_subparsers()`` object."""
    agent = subparsers.add_parser(
        "agent",
        help="run the machine agent (enroll, heartbeat, run jobs)",
        description="Run the Catacloud agent on this machine until the control plane terminates it.",
    )
    _agent_options(agent)
    agent.set_defaults(func=cmd_agent)

    meta = subparsers.add_parser(
        "job-meta",
        help="inside a job: print the metadata of one of its resources as JSON",
        description="Print the JSON metadata of the running job's resource NAME (exit 1 on error).",
    )
    meta.add_argument("name", metavar="NAME", help="the resource's name in the job configuration")
    meta.set_defaults(func=cmd_job_meta)

    checkpoint = subparsers.add_parser(
        "checkpoint",
        help="inside a job: save $CATACLOUD_CHECKPOINT_DIR to the control plane now",
        description="Upload the running job's checkpoint directory; returns once it is stored "
        "(exit 0), or prints why not (exit 1).",
    )
    checkpoint.add_argument(
        "--timeout",
        type=_positive_float,
        default=3600.0,
        metavar="SECONDS",
        help="give up waiting for the agent after this long (default 3600)",
    )
    checkpoint.set_defaults(func=cmd_checkpoint)
