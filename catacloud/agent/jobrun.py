"""Running one job on this machine, start to report: claim its start, make its folder, have its
image, restore its checkpoint, run its command in its sandbox with the checkpointer and the job
socket serving it, deliver its output, report its outcome, upload its outputs, remove its
folder. A part of :class:`catacloud.agent.main.Agent`, which holds the machine's state it reads
(the client, the job socket, the launcher, the image store, the running job)."""

from __future__ import annotations

import collections
import functools
import ipaddress
import logging
import os
import re
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from catacloud.agent import containers
from catacloud.agent.client import (
    AgentAPIError,
    AgentClient,
    Interrupted,
    Job,
    Unauthorized,
    allow_list,
    forget_secret,
    register_secret,
)
from catacloud.agent.disk import Area, DiskWatch
from catacloud.agent.files import (
    CHECKPOINT_ENV,
    OUTPUT_ENV,
    Checkpointer,
    list_outputs,
)
from catacloud.agent.imagejob import JobImages, image_cwd, image_process
from catacloud.agent.images import ImageError, PullCancelled, Pulled
from catacloud.agent.meta import SOCKET_ENV, TOKEN_ENV, MetaServer
from catacloud.agent.netns import Allow
from catacloud.agent.outputs import (
    FINISHED_RETRY_SECONDS,
    STOPPING_RETRY_SECONDS,
    restore_checkpoint,
    upload_outputs,
)
from catacloud.agent.reference import parse
from catacloud.agent.registry_proxy import Login, RegistryProxy
from catacloud.agent.runner import Cancellation, JobResult, LogStreamer, run_job_process
from catacloud.agent.sandbox import (
    NOT_CONFIRMED,
    SANDBOX_SOCKET,
    ImageRoot,
    JobPlace,
    Launcher,
)
from catacloud.agent.sandbox import UidAllocator as _UidAllocator
from catacloud.agent.workplace import give
from catacloud.protocol import ImagePulled, ImagesReport, Outcome

log = logging.getLogger("catacloud.agent")

# Why a running job ends when the agent ends it (its reported reason).
REASON_CANCELLED = "cancelled by the control plane"
REASON_TERMINATING = "machine terminating"
REASON_AGENT_STOPPED = "agent stopped"
REASON_INTERRUPTED = "spot interruption"
# A spot interruption notice: the job gets SIGTERM and this long to write its checkpoint (EC2's
# notice comes two minutes ahead; the rest is for the upload and the report), then SIGKILL.
INTERRUPTION_GRACE_SECONDS = 30.0


@dataclass
class CurrentJob:
    """The job this machine runs now."""

    job: Job
    cancel: Cancellation
    checkpointer: Checkpointer | None = None  # while its command runs
    interrupted: str = ""  # the spot interruption notice that ends it, when one does


class StartClaim:
    """The job's start told to the control plane in the background, meanwhile its folder and
    sandbox are made; called, its answer (waited for): ``True`` the job is this machine's. Nothing
    of the job runs before it answered yes (its sandbox waits at its gate): the report's round
    trip (across the internet, from a cloud machine) no longer comes before the sandbox's start."""

    def __init__(self, claim: Callable[[], bool]) -> None:
        self._done = threading.Event()
        self._ok = False
        self._error: BaseException | None = None
        self.at: float | None = None  # when it answered (time.monotonic())
        threading.Thread(target=self._run, args=(claim,), name="job-start", daemon=True).start()

    def _run(self, claim: Callable[[], bool]) -> None:
        try:
            self._ok = claim()
        except BaseException as exc:  # raised where the answer is asked for
            self._error = exc
        finally:
            self.at = time.monotonic()
            self._done.set()

    def __call__(self) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._ok


@dataclass(frozen=True)
class Attempt:
    """One run of a job here: its folder and user, its job-socket token, its cancellation, its log
    streamer, and when its time began (``time.monotonic()``; its image's pull counts)."""

    job: Job
    work_dir: str
    uid: int | None
    token: str
    cancel: Cancellation
    streamer: LogStreamer
    started: float
    claimed: StartClaim  # its start, confirmed by the control plane
    # When its command was launched after its start was confirmed (what of its folder, sandbox and
    # network, made meanwhile, was not ready by then) and how its network came: reported with its
    # outcome, for the job's timing.
    launch: dict[str, Any] = field(default_factory=dict)

    def launched(self, network: str) -> None:
        now = time.monotonic()
        since = max(self.started, self.claimed.at or self.started)
        self.launch.update(ms=round((now - since) * 1000, 1), network=network)


class JobRunning:
    """The job runner's half of the agent (its state lives on the agent)."""

    client: AgentClient
    meta: MetaServer | None
    launcher: Launcher
    job_uids: _UidAllocator | None
    work_root: str | None
    job_bin: str | None
    disk_reserve_bytes: int
    area: Area | None  # the jobs' file system of fixed size, where the machine has one
    area_baseline: int
    agent_tmp: str | None
    images: JobImages | None  # the machine's image store, where it can run images
    stopping: threading.Event
    _lock: threading.Lock
    _current: CurrentJob | None
    _cancelled: collections.OrderedDict[str, None]
    _stop_job_reason: str
    _report_on_stop: bool
    network_ahead: bool
    _next_uid: int | None  # the next job's, chosen when its network is made ahead
    _ahead: bool  # the next job's network is made (or being made) ahead
    _next_allow: tuple[Allow, ...]  # what the last job's machine type allows
    insecure_registries: tuple[str, ...]  # the operator's registries over plain HTTP (--insecure-registry)
    registry_proxy: RegistryProxy  # the organization's registry credentials for containers jobs

    def fatal(self, message: str) -> None:
        raise NotImplementedError

    def _cancel_job(self, job_id: str, reason: str) -> None:
        raise NotImplementedError

    def _report_interruption_now(self, detail: str) -> None:
        raise NotImplementedError

    def _report_crash(self, job: Job, exc: Exception) -> None:
        """Best effort after an agent bug: stop what the job left and report it failed."""
        with self._lock:
            current = self._current
        if current is None or current.job.id != job.id:
            return  # it never started
        try:
            if self.client.job_finished(
                job.id,
                exit_code=None,
                outcome=Outcome.FAILED,
                reason=f"agent error: {type(exc).__name__}",
                retry_for=STOPPING_RETRY_SECONDS,
            ):  # an older control plane holds the machine until uploads-done
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

    def _run_job(self, job: Job, received: float | None = None) -> None:
        """Claim the job's start, run it in its folder, report it, upload its outputs.
        ``received``: when the poll's answer arrived (``time.monotonic()``)."""
        arrived = time.monotonic() if received is None else received
        claimed = StartClaim(lambda: self._claim_start(job, arrived))
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
        launch: dict[str, Any] = {}
        uid = self._job_uid()
        try:
            work_dir = self._job_dir(job, uid)
            for folder in ("output", "checkpoint"):
                os.mkdir(os.path.join(work_dir, folder), 0o700)
                give(os.path.join(work_dir, folder), uid)
        except OSError as exc:
            result = JobResult(None, Outcome.FAILED, f"could not create the working directory: {exc}")
        else:
            run = Attempt(job, work_dir, uid, token, cancel, streamer, started, claimed)
            launch = run.launch
            try:
                result = self._execute(run)
            finally:
                forget_secret(token)
                for value in job.secret_values:
                    forget_secret(value)
        if not claimed():  # not this machine's: nothing of it ran, nothing to report
            self._drop(streamer, work_dir)
            return
        self._report(job, result, streamer, work_dir, launch)

    def _drop(self, streamer: LogStreamer, work_dir: str | None) -> None:
        """A job whose start the control plane did not confirm: its folder goes, unreported."""
        streamer.close(timeout=0.0)
        with self._lock:
            self._current = None
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)

    def _job_uid(self) -> int | None:
        """The uid of the job starting now: the one its network was made for (:meth:`prepare_next`),
        else the range's next."""
        uid, self._next_uid, self._ahead = self._next_uid, None, False
        if uid is None and self.job_uids is not None:
            uid = self.job_uids.take()
        return uid

    def prepare_next(self, *, wait: bool = False) -> None:
        """Choose the next job's uid and make its network now, unless that is done already: as the
        agent starts (``wait``: before it reports ready), as each job's command starts (the next
        network is made while the job runs), and after a job that did not get that far. The next
        job then waits for neither. It is made for the allow list of the last job (this machine's
        type's); a job with another gets its own."""
        if self.work_root is None or self.stopping.is_set() or not self.network_ahead or self._ahead:
            return
        self._next_uid = self.job_uids.take() if self.job_uids is not None else None
        self._ahead = True
        self.launcher.prepare_network(
            self._next_uid, self._next_uid, self._next_allow, self.work_root, wait=wait
        )

    def _claim_start(self, job: Job, received: float) -> bool:
        """Tell the control plane the job starts; False: it is not (or no longer) this machine's."""
        log.info("job %s (attempt %d) assigned", job.id, job.attempt)
        try:
            agent_ms = (time.monotonic() - received) * 1000
            if not self.client.job_started(
                job.id, interrupt=self.stopping, agent_ms=agent_ms, traceparent=job.traceparent
            ):
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

    def _execute(self, run: Attempt) -> JobResult:
        """Have the job's image when it names one (pulled, or from the machine's store), then
        run its command (:meth:`_run_command`)."""
        if run.job.image is None:
            return self._run_command(run, None)
        if not run.claimed():  # a pull is not made for a job that is not this machine's
            return JobResult(None, Outcome.FAILED, NOT_CONFIRMED)
        got = self._have_image(run.job, run.cancel, run.started)
        if isinstance(got, JobResult):
            return got
        assert self.images is not None and self.images.store is not None
        with self.images.store.pinned(got.image.digest):  # no eviction while it runs
            return self._run_command(run, got)

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

    def _run_command(self, run: Attempt, image: Pulled | None) -> JobResult:
        """Restore the job's checkpoint, then run its command (inside its image, when it has one)
        with the checkpointer and the job socket serving it, to its end."""
        assert self.meta is not None and self.work_root is not None
        job, work_dir, uid, cancel = run.job, run.work_dir, run.uid, run.cancel
        timeout = float(job.timeout_seconds)
        if timeout and image is not None:  # what the image's pull left of the job's time
            timeout -= time.monotonic() - run.started
            if timeout <= 0:
                return JobResult(
                    None, Outcome.TIMED_OUT, f"timed out after {job.timeout_seconds} s (its image's pull)"
                )
        watch = self._disk_watch(job, work_dir)
        if (full := watch.check()) is not None:  # no job starts on a disk below its host's reserve
            return JobResult(None, Outcome.FAILED, full)
        checkpoint_dir = os.path.join(work_dir, "checkpoint")
        tmp_dir = self.agent_tmp or self.work_root
        checkpointer = Checkpointer(
            job.id,
            checkpoint_dir,
            lambda archive, interrupt: self.client.put_checkpoint(job.id, archive, interrupt=interrupt),
            tmp_dir=tmp_dir,
            interval=job.checkpoint.interval_seconds,
        )
        if job.checkpoint.available and not cancel.is_set() and not self._restore(run, checkpointer):
            return JobResult(None, Outcome.FAILED, NOT_CONFIRMED)
        self.meta.grant(job.id, run.token, uid=uid)
        with self._lock:
            if self._current is not None:
                self._current.checkpointer = checkpointer
        checkpointer.start()
        log.info("job %s: running in %s", job.id, work_dir)
        grant = None
        try:
            allow = allow_list(job.network.allow)
            engine = job.containers and image is None
            if engine:
                allow, grant, mirrors = self._engine_registries(job, allow)
            self._next_allow = allow
            root = None
            if image is not None:
                root = ImageRoot(
                    rootfs=image.image.rootfs,
                    args=image_process(image.image, job.command),
                    cwd=image_cwd(image.image, work_dir),
                    mount_root=self.work_root,
                )
            if engine and (why := self._engine_missing()) is not None:
                return JobResult(None, Outcome.FAILED, why)
            place = JobPlace(work_dir, self.meta.path, uid, uid, allow=allow, image=root, containers=engine)
            socket_env = SANDBOX_SOCKET if self.launcher.kind == "bubblewrap" else self.meta.path
            image_env = image.image.config.env_map() if image is not None else None
            env = self._job_env(job, work_dir, run.token, socket_env, image_env)
            if engine:
                env = containers.prepare(work_dir, uid, env, self.insecure_registries, mirrors)
                give(containers.own_dir(work_dir), uid)
            return run_job_process(
                job.command,
                env=env,
                place=place,
                launcher=self.launcher,
                timeout_seconds=timeout,
                cancel=cancel,
                streamer=run.streamer,
                mask=job.secret_values,
                watch=watch,
                on_launch=functools.partial(self._launched, run),
                confirm=run.claimed,
            )
        finally:
            self.meta.revoke()
            if grant is not None:
                self.registry_proxy.revoke(grant)
            if cancel.reason == REASON_INTERRUPTED:
                self._save_before_interruption(job, checkpointer)
            with self._lock:
                if self._current is not None:
                    self._current.checkpointer = None
            checkpointer.close()

    def _launched(self, run: Attempt, network: str) -> None:
        """The job's command runs: its launch is timed, and the next job's network is made
        meanwhile (ready when this job ends: a job that comes at once does not wait for it)."""
        run.launched(network)
        try:
            self.prepare_next()
        except Exception:  # the job runs on; its successor's network is made at its start instead
            log.exception("could not start making the next job's network")

    def _restore(self, run: Attempt, checkpointer: Checkpointer) -> bool:
        """The job's last checkpoint into its folder, once its start is confirmed (False: not)."""
        if not run.claimed():
            return False
        restore_checkpoint(
            self.client, run.job, checkpointer.directory, run.cancel, tmp_dir=checkpointer.tmp_dir
        )
        give(checkpointer.directory, run.uid)
        checkpointer.mark_saved()
        return True

    def _save_before_interruption(self, job: Job, checkpointer: Checkpointer) -> None:
        """The job had its SIGTERM and grace to write its checkpoint directory; upload what it
        holds now (if it changed since the last save), before the interruption is reported:
        the control plane requeues the job on that report and refuses its checkpoints after."""
        try:
            checkpointer.save(REASON_INTERRUPTED, only_if_changed=True)
        except Unauthorized:
            raise
        except Exception as exc:  # whatever happens, the interruption must still be reported
            log.warning("job %s: no checkpoint before the interruption: %s", job.id, exc)

    def _engine_registries(
        self, job: Job, allow: tuple[Allow, ...]
    ) -> tuple[tuple[Allow, ...], str | None, list[tuple[Login, str]]]:
        """The registries the job's engine pulls through this agent's mirror
        (catacloud/agent/registry_proxy.py): the organization's, with its credentials, and those
        of the images the machine's store holds (their blobs come from the store). Returns the
        job's allow list with the mirror's port (pasta forwards it into the job's namespace), the
        grant, and the mirror locations its registries.conf names. Nothing where the job has no
        network of its own to reach it through."""
        egress = getattr(self.launcher, "egress", None)
        store = self.images.store if self.images is not None and self.images.opened else None
        held = store.registries() if store is not None else set()
        if not (job.registries or held) or egress is None or egress.mode != "pasta":
            return allow, None, []
        plain = {h.lower() for h in self.insecure_registries}
        logins = {
            r.registry: Login(r.registry, r.username, r.password, parse(f"{r.registry}/x").plain_http(plain))
            for r in job.registries
        }
        for registry in sorted(held - set(logins)):
            logins[registry] = Login(registry, plain_http=parse(f"{registry}/x").plain_http(plain))
        seed = store.blob_for if store is not None else None
        grant, mirrors = self.registry_proxy.grant(logins.values(), egress.policy(allow), seed)
        mirror = Allow(ipaddress.ip_network("127.0.0.1/32"), self.registry_proxy.port)
        return (*allow, mirror), grant, mirrors

    def _engine_missing(self) -> str | None:
        """Why this machine cannot give a job its own container engine, or None."""
        if self.launcher.kind != "bubblewrap":
            return "its machine type allows containers, but this machine runs jobs without the sandbox"
        if containers.engine_path() is None:
            return (
                "its machine type allows containers, but this machine has no podman "
                f"(apt-get install {' '.join(containers.HOST_PACKAGES)})"
            )
        return None

    def _disk_watch(self, job: Job, work_dir: str) -> DiskWatch:
        """The job's disk watchdog: its area's use, where the machine has one (the kernel bounds
        it), else its files and what its processes hold open; and the host's reserve."""
        assert self.work_root is not None
        return DiskWatch(
            work_dir,
            job.disk_limit_bytes,
            reserve_bytes=self.disk_reserve_bytes,
            area=self.area,
            host_folder=os.path.dirname(self.work_root.rstrip("/")) if self.area is not None else "",
            baseline_bytes=self.area_baseline,
        )

    def _report(
        self,
        job: Job,
        result: JobResult,
        streamer: LogStreamer,
        work_dir: str | None,
        launch: dict[str, Any] | None = None,
    ) -> None:
        """Deliver the job's output, report its outcome, upload its output files, remove its
        folder (the next job, maybe of another uid, finds nothing of this one). A job a spot
        interruption ended is not reported as ended: the interruption is (it is requeued)."""
        with self._lock:
            notice = self._current.interrupted if self._current is not None else ""
        if notice and result.reason == REASON_INTERRUPTED:
            streamer.close(timeout=STOPPING_RETRY_SECONDS)
            log.info("job %s: ended by the spot interruption; reporting it", job.id)
            self._report_interruption_now(notice)
            with self._lock:
                self._current = None
            if work_dir is not None:
                shutil.rmtree(work_dir, ignore_errors=True)
            return
        if self.stopping.is_set() and not self._report_on_stop:
            streamer.close(timeout=0.0)
            log.info("job %s: %s (%s); not reported", job.id, result.outcome, result.reason)
            if work_dir is not None:
                shutil.rmtree(work_dir, ignore_errors=True)
            return
        # The job's output first, retried from the streamer's spool for as long as the report
        # itself would be (then the report goes anyway: the outcome matters more).
        retry_for = STOPPING_RETRY_SECONDS if self.stopping.is_set() else FINISHED_RETRY_SECONDS
        # What is left of it goes with the report when the control plane takes it there (a short
        # job's output and end in one request), else on its own first.
        left = streamer.hand_over() if job.final_output else None
        if left is None and not streamer.close(timeout=retry_for):
            log.warning("job %s: some output could not be delivered", job.id)
        log.info("job %s finished: %s (%s)", job.id, result.outcome, result.reason)
        outputs = list_outputs(os.path.join(work_dir, "output")) if work_dir is not None else []
        awaited = True  # the control plane waits for uploads-done (unless its answer says not)
        try:
            awaited = self.client.job_finished(
                job.id,
                exit_code=result.exit_code,
                outcome=result.outcome,
                reason=result.reason,
                uploads_pending=len(outputs),
                code=result.code,
                retry_for=retry_for,
                traceparent=job.traceparent,
                launch_ms=(launch or {}).get("ms"),
                network=(launch or {}).get("network", ""),
                output=left or (),
            )
        except Unauthorized:
            raise
        except AgentAPIError as exc:
            log.error("job %s: could not report its outcome: %s", job.id, exc)
        with self._lock:
            # A notice that came while the outcome was reported was left to this run: read it
            # under the lock that ends the run (after this, the watcher reports a notice itself).
            notice = self._current.interrupted if self._current is not None else notice
            self._current = None  # reported: heartbeats no longer name it, nothing left to cancel
        try:
            upload_outputs(self.client, job, outputs, stopping=self.stopping, awaited=awaited)
        finally:
            if work_dir is not None:
                shutil.rmtree(work_dir, ignore_errors=True)
            if notice:  # it ended on its own as the notice came: its outputs first, then the machine's end
                self._report_interruption_now(notice)
