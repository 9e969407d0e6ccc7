"""Running one job: its own uid and sandbox, streamed output, timeout, cancellation.

How the job's command starts (a bubblewrap sandbox per job, or a small supervisor where
bubblewrap cannot run) is :mod:`catacloud.agent.sandbox`'s business; either way the whole tree the
job starts dies with the agent, even when the agent is SIGKILLed, so a requeued attempt never
runs beside it.

Two reader threads feed stdout and stderr into one ordered :class:`LogStreamer`, whose
flusher thread ships chunks while the job runs. Stopping a job (timeout, cancel, agent exit)
kills the whole tree: SIGTERM to the group and to every descendant seen (also those that left the
group), a grace period, then SIGKILL.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any, Protocol

import psutil

from catacloud.agent.backoff import backoff
from catacloud.agent.client import redact
from catacloud.agent.masking import OutputMasker
from catacloud.agent.sandbox import NOT_CONFIRMED, JobPlace, Launch, Launcher
from catacloud.protocol import Outcome

log = logging.getLogger("catacloud.agent")

SUCCEEDED, FAILED, TIMED_OUT, CANCELLED = Outcome  # how a job ends: the protocol's one enum

KILL_GRACE_SECONDS = 3.0
# What holds a job's sandbox, never the job itself (ProcessTree.tell passes them by).
LAUNCHER_NAMES = frozenset({"bwrap", "nsenter"})


class Watch(Protocol):
    """Checked while a job runs (the disk watchdog): a reason to end it, or ``None``."""

    def __call__(self, *, force: bool = False) -> str | None: ...

    def follow(self, pids: Callable[[], Iterable[int]]) -> None:
        """The job's processes, once it runs (what they hold open counts too)."""


@dataclass(frozen=True)
class JobResult:
    """What ``finished`` reports."""

    exit_code: int | None
    outcome: Outcome
    reason: str
    code: str = ""  # an ImageFailure value: the job's image could not be had


class Cancellation:
    """A one-way cancel flag carrying the first reason given."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason = ""
        self.grace: float | None = None

    def cancel(self, reason: str, *, grace: float | None = None) -> bool:
        """Request cancellation; ``True`` if this call was the first. ``grace``: the job is told
        first (SIGTERM to its own processes, not its sandbox) and has this long to end by itself
        before its whole tree is killed; without it the tree is killed at once (SIGTERM, a short
        grace, SIGKILL)."""
        with self._lock:
            if self._event.is_set():
                return False
            self.reason = reason
            self.grace = grace
            self._event.set()
            return True

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


# -- output streaming ---------------------------------------------------------------------------


class LogStreamer:
    """Collects a job's stdout and stderr in arrival order and ships them while it runs.

    ``send(chunks)`` posts chunks and answers whether the job was cancelled; it raises on failure
    (an exception's ``retry_after`` is the server's Retry-After). Each chunk gets its sequence
    number once, so a retried post repeats the same numbers and the server drops what it
    already has. Output is flushed at least every ``flush_interval`` seconds, and at once when
    ``flush_bytes`` are waiting.

    Output the server did not take (refused, dropped, unreachable) is never dropped while the
    job's report waits: it stays here, in order, and is posted again with backoff (never
    sooner than a Retry-After) until the server takes it or :meth:`close`'s deadline, which
    gets one last try. The spool is memory, bounded: ``max_buffered`` characters waiting
    (16 Mi) plus one post being retried (``max_post_chars``); when it is full the readers
    block, and so does the job when its pipe fills: output is delayed, not lost.
    """

    def __init__(
        self,
        send: Callable[[list[dict[str, Any]]], bool],
        *,
        on_cancel: Callable[[], None] | None = None,
        flush_interval: float = 0.5,
        flush_bytes: int = 16 * 1024,
        max_chunk_chars: int = 32 * 1024,
        max_post_chars: int = 256 * 1024,
        max_buffered: int = 16 * 1024 * 1024,
        retry_base: float = 0.5,
        retry_cap: float = 10.0,
        last_try: float = 20.0,
    ) -> None:
        self._send = send
        self._on_cancel = on_cancel
        self.flush_interval = flush_interval
        self.flush_bytes = flush_bytes
        self.max_chunk_chars = max_chunk_chars
        self.max_post_chars = max_post_chars
        self.max_buffered = max_buffered
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.last_try = last_try  # longer than a post may take (the client's request timeout)
        self._cond = threading.Condition()
        self._decoders = {
            stream: codecs.getincrementaldecoder("utf-8")(errors="replace") for stream in ("stdout", "stderr")
        }
        self._pending: list[tuple[str, str]] = []
        self._pending_chars = 0
        self._first_pending_at = 0.0
        self._unacked: list[dict[str, Any]] = []
        self._next_seq = 0
        self._closing = False
        self._close_deadline = 0.0
        self._discard = False
        self._failures = 0
        self._retry_at = 0.0
        self._not_before = 0.0  # the server's Retry-After, which not even close() hurries
        self.sent_chunks = 0
        self._thread = threading.Thread(target=self._run, name="log-flusher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # readers' side

    def feed(self, stream: str, data: bytes) -> None:
        """Add raw bytes read from ``stream`` (``stdout`` or ``stderr``)."""
        with self._cond:
            text = self._decoders[stream].decode(data)
            self._append(stream, text)

    def end_stream(self, stream: str) -> None:
        """The stream hit EOF: flush its decoder (an incomplete UTF-8 tail becomes U+FFFD)."""
        with self._cond:
            self._append(stream, self._decoders[stream].decode(b"", final=True))

    def _append(self, stream: str, text: str) -> None:
        if not text:
            return
        while self._pending_chars >= self.max_buffered and not self._discard:
            self._cond.wait(0.5)
        if self._discard:
            return
        first = not self._pending
        if first:
            self._first_pending_at = time.monotonic()
        self._pending.append((stream, text))
        self._pending_chars += len(text)
        if first or self._pending_chars >= self.flush_bytes:
            self._cond.notify_all()  # the flusher starts its 0.5 s clock, or flushes now

    # flusher's side

    def _take(self) -> None:
        """Move pending output into numbered, coalesced chunks (caller holds the lock)."""
        for stream, text in self._pending:
            last = self._unacked[-1] if self._unacked else None
            if (
                last is not None
                and not last.get("_sent")
                and last["stream"] == stream
                and len(last["data"]) + len(text) <= self.max_chunk_chars
            ):
                last["data"] += text
                continue
            for start in range(0, len(text), self.max_chunk_chars):
                self._unacked.append(
                    {
                        "seq": self._next_seq,
                        "stream": stream,
                        "data": text[start : start + self.max_chunk_chars],
                    }
                )
                self._next_seq += 1
        self._pending.clear()
        self._pending_chars = 0
        self._cond.notify_all()

    def _due(self, now: float) -> bool:
        if now < self._retry_at:
            return False
        if self._unacked:
            return True
        return bool(self._pending) and (
            self._closing
            or self._pending_chars >= self.flush_bytes
            or now >= self._first_pending_at + self.flush_interval
        )

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._discard:
                        return
                    if self._closing and not self._pending and not self._unacked:
                        return
                    if self._due(now):
                        break  # past close's deadline too: the retry due at it is the last try
                    if self._closing and now > self._close_deadline:
                        self._discard = True
                        self._cond.notify_all()
                        return
                    if now < self._retry_at:
                        wait: float | None = self._retry_at - now
                    elif self._pending:
                        wait = self._first_pending_at + self.flush_interval - now
                    else:
                        wait = None
                    if self._closing:
                        wait = min(wait if wait is not None else 0.5, self._close_deadline - now + 0.01)
                    self._cond.wait(max(0.01, wait) if wait is not None else None)
                # Number new output only while the backlog is small: when the server is away,
                # output stays pending and eventually pushes back on the job.
                if self._pending and sum(len(c["data"]) for c in self._unacked) < self.max_post_chars:
                    self._take()
                batch: list[dict[str, Any]] = []
                size = 0
                for chunk in self._unacked:
                    if batch and size + len(chunk["data"]) > self.max_post_chars:
                        break
                    chunk["_sent"] = True
                    batch.append(chunk)
                    size += len(chunk["data"])
            if batch:
                self._post(batch)

    def _post(self, batch: list[dict[str, Any]]) -> None:
        wire = [{"seq": c["seq"], "stream": c["stream"], "data": c["data"]} for c in batch]
        try:
            cancel = self._send(wire)
        except Exception as exc:
            hint = getattr(exc, "retry_after", None)
            with self._cond:
                delay = backoff(
                    self._failures, base=self.retry_base, cap=self.retry_cap, hint=hint, jitter=(1.0, 1.0)
                )
                self._failures += 1
                now = time.monotonic()
                self._retry_at = now + delay
                self._not_before = now + hint if hint else 0.0
                give_up = self._closing and now >= self._close_deadline
                if self._closing:
                    # not given up early: the last try comes at the deadline, whatever the backoff
                    self._retry_at = min(self._retry_at, self._close_deadline)
                    delay = self._retry_at - now
                if give_up:
                    self._discard = True
                    self._cond.notify_all()
            if give_up:
                log.warning("could not ship job output (%s); giving up", redact(str(exc)))
            else:
                log.warning("could not ship job output (%s); retrying in %.1f s", redact(str(exc)), delay)
            return
        with self._cond:
            self._failures = 0
            self._retry_at = self._not_before = 0.0
            acked = {c["seq"] for c in batch}
            self._unacked = [c for c in self._unacked if c["seq"] not in acked]
            self.sent_chunks += len(batch)
        if cancel and self._on_cancel is not None:
            self._on_cancel()

    def hand_over(self) -> list[dict[str, Any]] | None:
        """Stop shipping and return what is left, numbered, for the job's exit report to carry
        (``Finished.output``): everything before it was acknowledged and none of it is in flight.
        ``None`` (nothing stopped) when a post is in flight or being retried, or when more is
        left than one post carries: :meth:`close` ships it then, as it would have."""
        with self._cond:
            if self._discard or any(chunk.get("_sent") for chunk in self._unacked):
                return None
            left = self._pending_chars + sum(len(chunk["data"]) for chunk in self._unacked)
            if left > self.max_post_chars:
                return None
            self._take()
            chunks = [{"seq": c["seq"], "stream": c["stream"], "data": c["data"]} for c in self._unacked]
            self._unacked = []
            self._closing = self._discard = True  # the flusher ends; output fed later is dropped
            self._cond.notify_all()
        self._thread.join(self.last_try)
        return chunks

    def close(self, timeout: float) -> bool:
        """Ship what is left, retrying up to ``timeout`` s (the last try starts then, and gets
        ``last_try`` s to end); ``True`` if everything was acknowledged. 0: ship nothing more."""
        with self._cond:
            self._closing = True
            self._close_deadline = time.monotonic() + timeout
            # what is left goes now, unless the server asked for a pause (Retry-After)
            self._retry_at = min(self._not_before, self._close_deadline)
            if timeout <= 0:
                self._discard = True
            self._cond.notify_all()
        if self._thread.is_alive() and timeout > 0:
            self._thread.join(timeout + self.last_try)
        with self._cond:
            delivered = not self._pending and not self._unacked
            self._discard = True
            self._cond.notify_all()
        return delivered


# -- process tree -------------------------------------------------------------------------------


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (``SigCgt`` of /proc/PID/status, a mask
    whose bit ``signum - 1`` is set for each caught signal: proc(5))."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


class ProcessTree:
    """Every process a job started: its process group plus descendants seen along the way."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pgid = pid  # start_new_session=True: the shell leads its own session and group
        self._known: dict[tuple[int, float], psutil.Process] = {}
        try:
            self._root: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:
            self._root = None

    def snapshot(self) -> None:
        """Remember the current descendants, so ones that later leave the group are still found."""
        if self._root is None:
            return
        try:
            children = self._root.children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            try:
                self._known[(child.pid, child.create_time())] = child
            except psutil.Error:
                continue
        self._known = {key: p for key, p in self._known.items() if _alive(p)}

    def pids(self) -> list[int]:
        """The tree's first process and the descendants known now (no scan of every process)."""
        self.snapshot()
        return [self.pid, *(p.pid for p in self._known.values())]

    def members(self) -> list[psutil.Process]:
        """Live processes of the tree: known descendants and whatever is still in the group."""
        self.snapshot()
        found = {key: p for key, p in self._known.items() if _alive(p)}
        for process in psutil.process_iter():
            if process.pid == self.pid:
                continue
            try:
                if os.getpgid(process.pid) == self.pgid:
                    found.setdefault((process.pid, process.create_time()), process)
            except (OSError, psutil.Error):
                continue
        return [p for p in found.values() if p.pid != self.pid and p.pid != os.getpid()]

    def _signal(self, processes: Iterable[psutil.Process], signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signum)  # psutil refuses a reused pid

    def tell(self, signum: int) -> int:
        """Send ``signum`` to the job's processes that catch it (a program with a handler, a
        shell with a ``trap``), and to no other: not what holds its sandbox (the launcher this
        agent started, bubblewrap, nsenter), and not a process that would die of it, such as the
        shell running ``cd dir && python train.py``: its end would end the sandbox, and every
        process in it, before the program that handles the signal had its time. How many
        processes were told."""
        told = 0
        for process in self.members():
            with contextlib.suppress(psutil.Error):
                if process.pid == self.pid or process.name() in LAUNCHER_NAMES:
                    continue
                if not catches(process.pid, signum):
                    continue
                process.send_signal(signum)
                told += 1
        return told

    def kill(self, proc: subprocess.Popen[bytes] | None, grace: float = KILL_GRACE_SECONDS) -> None:
        """SIGTERM the tree, wait up to ``grace`` s, then SIGKILL what is left.

        ``proc`` is the job's shell when it is still running (it is our child: reaped by ``proc``).
        """
        processes = self.members()
        if proc is not None and proc.poll() is not None:
            proc = None
        if not processes and proc is None:
            return
        self._signal(processes, signal.SIGTERM)
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if (proc is None or proc.poll() is not None) and not any(_alive(p) for p in processes):
                return
            time.sleep(0.05)
        leftovers = [p for p in self.members() if _alive(p)]
        log.info("job processes outlived SIGTERM by %.0f s; sending SIGKILL", grace)
        self._signal(leftovers, signal.SIGKILL)
        if proc is not None:
            proc.kill()
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                log.warning("job process %s survived SIGKILL", proc.pid)
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(_alive(p) for p in leftovers):
            time.sleep(0.05)


def _pump(pipe: IO[bytes], stream: str, masker: OutputMasker) -> None:
    fd = pipe.fileno()
    try:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            masker.feed(stream, data)
    finally:
        masker.end(stream)
        pipe.close()


def _supervise(
    proc: subprocess.Popen[bytes],
    tree: ProcessTree,
    timeout_seconds: float,
    cancel: Cancellation,
    kill_grace: float,
    poll_interval: float,
    watch: Watch | None = None,
) -> tuple[Outcome, str] | None:
    """Wait for the job to end; on timeout, cancellation or a ``watch`` that answers a reason
    (the disk watchdog, which follows the tree's processes) kill its tree and say why."""
    if watch is not None:
        watch.follow(tree.pids)
    started = time.monotonic()
    deadline = started + timeout_seconds if timeout_seconds and timeout_seconds > 0 else None
    next_snapshot = started
    told_until: float | None = None  # a cancellation with a grace: the job was told, and has until
    while True:
        try:
            proc.wait(timeout=poll_interval)
        except subprocess.TimeoutExpired:
            pass
        else:  # ended: what it left on the disk still counts
            why = watch(force=True) if watch is not None else None
            if why is None and told_until is not None:
                return (CANCELLED, cancel.reason)  # it ended because it was told to
            return (FAILED, why) if why is not None else None
        now = time.monotonic()
        if now >= next_snapshot:
            tree.snapshot()
            next_snapshot = now + 0.5
        stopped: tuple[Outcome, str] | None = None
        if cancel.is_set() and cancel.grace is not None and told_until is None:
            # Told first (SIGTERM to its processes that handle it): it may save its work and
            # exit. None handles it: nothing to wait for.
            told = tree.tell(signal.SIGTERM)
            log.info(
                "job told to stop (%s): SIGTERM to %d process(es), %.0f s", cancel.reason, told, cancel.grace
            )
            told_until = now + (cancel.grace if told else 0.0)
        if told_until is not None:
            if now >= told_until:
                stopped = (CANCELLED, cancel.reason)
        elif cancel.is_set():
            stopped = (CANCELLED, cancel.reason or "cancelled")
        elif deadline is not None and now >= deadline:
            stopped = (TIMED_OUT, f"timed out after {timeout_seconds:g} s")
        elif watch is not None and (why := watch()) is not None:
            stopped = (FAILED, why)
        if stopped is not None:
            log.info("stopping job process tree (%s)", stopped[1])
            tree.kill(proc, kill_grace)
            proc.wait()
            return stopped


def run_job_process(
    command: str,
    *,
    env: dict[str, str],
    place: JobPlace,
    launcher: Launcher,
    timeout_seconds: float,
    cancel: Cancellation,
    streamer: LogStreamer,
    kill_grace: float = KILL_GRACE_SECONDS,
    poll_interval: float = 0.1,
    mask: Iterable[str] = (),
    watch: Watch | None = None,
    on_launch: Callable[[str], None] | None = None,
    confirm: Callable[[], bool] | None = None,
) -> JobResult:
    """Run ``command`` to its end, a timeout or a cancellation; never raises for job failures.

    ``env`` is the job's whole environment (nothing of the agent's is added); only the job's own
    process gets it (see :mod:`catacloud.agent.sandbox`). ``place`` says where it runs and as
    whom. Values in ``mask`` become ``***`` in its output (catacloud/agent/masking.py says in
    which forms). ``confirm`` (the job's start told to the control plane, its answer) is waited
    for once the sandbox is made and held before the command: nothing of the command runs unless
    it answers yes (then the result's reason is :data:`NOT_CONFIRMED`)."""
    if cancel.is_set():
        return JobResult(None, CANCELLED, cancel.reason)
    started = _start(command, env, place, launcher, confirm)
    if isinstance(started, JobResult):
        return started
    launch, proc = started
    if on_launch is not None:  # the command runs now (or is about to: bubblewrap's last steps)
        on_launch(launch.network_kind())
    assert proc.stdout is not None and proc.stderr is not None
    masker = OutputMasker(mask, streamer.feed, streamer.end_stream)  # both streams as one sequence
    readers = [
        threading.Thread(target=_pump, args=(proc.stdout, "stdout", masker), name="job-stdout", daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, "stderr", masker), name="job-stderr", daemon=True),
    ]
    for reader in readers:
        reader.start()
    tree = ProcessTree(proc.pid)
    try:
        stopped = _supervise(proc, tree, timeout_seconds, cancel, kill_grace, poll_interval, watch)
    except BaseException:
        tree.kill(proc, grace=0.5)  # never leave a job running behind an agent error
        raise
    finally:
        launch.finish()
    returncode = proc.returncode
    # Whatever the job left running in the background goes with it (and releases our pipes).
    tree.kill(None, grace=min(1.0, kill_grace))
    for reader in readers:
        reader.join(timeout=5.0)
        if reader.is_alive():
            log.warning("job output %s is still open after the job ended; not waiting for it", reader.name)
    if stopped is not None:
        return JobResult(None, *stopped)
    return _exit_result(returncode)


def _start(
    command: str,
    env: dict[str, str],
    place: JobPlace,
    launcher: Launcher,
    confirm: Callable[[], bool] | None,
) -> tuple[Launch, subprocess.Popen[bytes]] | JobResult:
    """The job's sandbox started, its network up and (``confirm``) its start confirmed meanwhile:
    its command runs now. Else why not, nothing of the command run."""
    try:
        launch = launcher.launch(command, env, place, held=confirm is not None)
    except OSError as exc:
        return JobResult(None, FAILED, f"could not prepare the job's sandbox: {exc}")
    if confirm is not None and launch.gate is None and not confirm():  # nothing holds it: ask first
        launch.close()
        launch.finish()
        return JobResult(None, FAILED, NOT_CONFIRMED)
    try:
        proc = launch.spawn(stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, bufsize=0)
    except OSError as exc:
        return JobResult(None, FAILED, f"could not start the command: {exc}")
    why = launch.begin(proc, confirm)
    if why == NOT_CONFIRMED:
        return JobResult(None, FAILED, NOT_CONFIRMED)
    if why is not None:
        return JobResult(None, FAILED, f"could not set up the job's network: {why}")
    return launch, proc


def _exit_result(returncode: int) -> JobResult:
    """The outcome of an exit status. A sandbox reports a command killed by signal N as exit
    code 128 + N, as shells do; the supervisor re-raises the signal (a negative return code)."""
    if returncode == 0:
        return JobResult(0, SUCCEEDED, "exit code 0")
    if returncode < 0:
        return JobResult(128 - returncode, FAILED, f"killed by signal {_signal_name(-returncode)}")
    if 128 < returncode < 128 + signal.NSIG:
        return JobResult(returncode, FAILED, f"exit code {returncode} ({_signal_name(returncode - 128)})")
    return JobResult(returncode, FAILED, f"exit code {returncode}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
