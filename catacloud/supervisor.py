"""A small process supervisor for `make dev`: start programs, restart the ones that die.

honcho's ``Manager`` (what `make dev` used before) stops everything when one process exits,
so a crashed worker took the whole dev system down. supervisord and circus restart, but they
are daemons with their own configuration files, control sockets and (circus) ZeroMQ: a lot of
machinery for four processes in a terminal. This is the part we need, on ``subprocess``:

- every program runs in its own session (so Ctrl-C reaches only the supervisor, which then
  stops the programs in order) with its output prefixed by its name;
- a program that exits while the supervisor runs is restarted after ``restart_delay`` seconds,
  doubling up to ``max_restart_delay`` while it keeps dying within ``stable_after`` seconds of
  its start, with a log line saying so;
- ``stop()`` (or SIGINT/SIGTERM/SIGHUP when ``run`` is in the main thread) sends each program's
  ``stop_signal`` (SIGTERM unless it says otherwise) to the program itself, not to its process
  group: it stops its own children in order (a Celery worker finishes the tasks in flight, then
  ends its pool; a pool child signalled directly died under its task). It waits up to
  ``stop_timeout`` seconds, then SIGKILLs what is left of each group; output that can no
  longer be written (a closed terminal: EIO) is dropped, never the stop; ``on_stop`` (optional)
  runs in a thread meanwhile, and the stop returns once it has too (``make dev``: end the local
  machines, which must not wait for a worker that takes its ``stop_timeout``);
- **nothing outlives it**, not even when it is SIGKILLed (the OOM killer, a CI timeout, a
  closed terminal): a small watchdog process in a session of its own holds the read end of a
  pipe only the supervisor writes to, and learns from it every program's process group. When
  the pipe ends without the supervisor's goodbye, the watchdog stops every group (stop signal,
  then SIGKILL) and runs ``on_orphan`` (``make dev``: stop the local machines and the embedded
  services this run started);
- ``state_file`` (optional) names every program's pid and start time while it runs, so a
  later start can refuse to run beside a previous one whose supervisor died
  (:func:`leftovers`).

No Django here: ``catacloud/`` never imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from catacloud.agent.signals import STOP_SIGNALS, handle_signals


@dataclass
class Program:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    # What asks it to stop at once (gunicorn: SIGINT is its quick shutdown; SIGTERM would wait
    # for open requests, e.g. agents' long polls, up to its graceful timeout).
    stop_signal: signal.Signals = signal.SIGTERM


@dataclass
class _Child:
    program: Program
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    delay: float = 0.0
    restart_at: float | None = None
    reader: threading.Thread | None = None
    pids: list[int] = field(default_factory=list)  # every pid it ever had, newest last


class Supervisor:
    def __init__(
        self,
        programs: Sequence[Program],
        *,
        out: IO[str] | None = None,
        restart_delay: float = 1.0,
        max_restart_delay: float = 30.0,
        stable_after: float = 30.0,
        stop_timeout: float = 10.0,
        poll_interval: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        on_orphan: Sequence[str] = (),
        on_stop: Callable[[], None] | None = None,
        state_file: Path | None = None,
    ) -> None:
        names = [p.name for p in programs]
        if len(set(names)) != len(names):
            raise ValueError(f"program names must be unique: {names}")
        self.children = {p.name: _Child(program=p, delay=restart_delay) for p in programs}
        self.out = out or sys.stdout
        self.restart_delay = restart_delay
        self.max_restart_delay = max_restart_delay
        self.stable_after = stable_after
        self.stop_timeout = stop_timeout
        self.poll_interval = poll_interval
        self.clock = clock
        self._stopping = threading.Event()
        self._write_lock = threading.Lock()
        self._width = max((len(n) for n in names), default=0)
        self.on_orphan = list(on_orphan)
        self.on_stop = on_stop
        self.state_file = state_file
        self.watchdog: subprocess.Popen[bytes] | None = None

    # ---- output ---------------------------------------------------------------------------------

    def log(self, message: str, name: str = "catacloud") -> None:
        stamp = time.strftime("%H:%M:%S")
        self._write(f"{stamp} {name.ljust(self._width)} | {message}\n")

    def announce(self, text: str) -> None:
        """Write ``text`` as it is (no prefix), between the programs' lines."""
        self._write(text if text.endswith("\n") else text + "\n")

    def _write(self, text: str) -> None:
        # A closed terminal answers EIO, a closed pipe EPIPE: the output is lost, but stopping
        # (and the programs' pipes, still drained) must go on.
        with self._write_lock, contextlib.suppress(OSError, ValueError):
            self.out.write(text)
            self.out.flush()

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.log(raw.decode(errors="replace").rstrip("\n"), name)
        stream.close()

    # ---- processes --------------------------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        child = self.children[name]
        return child.popen.pid if child.popen is not None and child.popen.poll() is None else None

    def _start_watchdog(self) -> None:
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "catacloud.supervisor", "watchdog", *self.on_orphan],
            stdin=subprocess.PIPE,
            stdout=self.out if _has_fileno(self.out) else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if _has_fileno(self.out) else subprocess.DEVNULL,
            start_new_session=True,  # neither Ctrl-C nor a kill of our group reaches it
            cwd=str(Path(__file__).resolve().parent.parent),
        )

    def _tell(self, line: str) -> None:
        """A line for the watchdog (it may be gone: then there is nobody to tell)."""
        if self.watchdog is None or self.watchdog.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self.watchdog.stdin.write(line.encode() + b"\n")
            self.watchdog.stdin.flush()

    def _save_state(self) -> None:
        if self.state_file is None:
            return
        state = {}
        for name, child in self.children.items():
            if child.popen is not None and child.popen.poll() is None:
                with contextlib.suppress(psutil.Error):
                    started = psutil.Process(child.popen.pid).create_time()
                    state[name] = {"pid": child.popen.pid, "started": started}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"supervisor": os.getpid(), "programs": state}))
        tmp.replace(self.state_file)

    def _start(self, child: _Child) -> None:
        p = child.program
        child.popen = subprocess.Popen(
            p.argv,
            env=p.env,
            cwd=p.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        child.started_at = self.clock()
        child.restart_at = None
        child.pids.append(child.popen.pid)
        self._tell(f"+{child.popen.pid}")  # its own session: the group id is its pid
        self._save_state()
        assert child.popen.stdout is not None
        child.reader = threading.Thread(
            target=self._pump, args=(p.name, child.popen.stdout), name=f"out-{p.name}", daemon=True
        )
        child.reader.start()
        self.log(f"started {p.name} (pid {child.popen.pid})")

    def start(self) -> None:
        if self.watchdog is None:
            self._start_watchdog()
        for child in self.children.values():
            self._start(child)

    def check(self) -> None:
        """One supervision step: notice exits, restart what is due."""
        now = self.clock()
        for child in self.children.values():
            if self._stopping.is_set():
                return
            popen = child.popen
            if popen is not None and child.restart_at is None and popen.poll() is not None:
                ran = now - child.started_at
                if ran >= self.stable_after:
                    child.delay = self.restart_delay
                child.restarts += 1
                child.restart_at = now + child.delay
                self.log(
                    f"{child.program.name} (pid {popen.pid}) exited with {_describe(popen.returncode)} "
                    f"after {ran:.0f}s; restarting in {child.delay:g}s (restart {child.restarts})"
                )
                child.delay = min(child.delay * 2, self.max_restart_delay)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)  # its orphans (e.g. prefork children) too
                self._tell(f"-{popen.pid}")
            if child.restart_at is not None and now >= child.restart_at:
                self._start(child)
                self.log(f"restarted {child.program.name} (pid {child.popen.pid})")  # type: ignore[union-attr]

    def run(self) -> int:
        """Start everything and supervise until ``stop()`` or SIGINT/SIGTERM; then stop all."""
        restore = None
        if threading.current_thread() is threading.main_thread():
            # the handler itself must not call Event.set (catacloud/agent/signals.py)
            restore = handle_signals(STOP_SIGNALS, lambda signum: self._stopping.set())
        try:
            if not self._stopping.is_set():  # (a stop() before the run starts nothing)
                self.start()
            while not self._stopping.wait(self.poll_interval):
                self.check()
        finally:
            self._shutdown()
            if restore is not None:
                restore()
        return 0

    def stop(self) -> None:
        self._stopping.set()

    def _on_stop(self) -> None:
        try:
            self.on_stop()  # type: ignore[misc]
        except Exception as exc:  # the stop goes on: its programs must end all the same
            self.log(f"while stopping: {type(exc).__name__}: {exc}")

    def _shutdown(self) -> None:
        self._stopping.set()
        beside = None
        if self.on_stop is not None:
            beside = threading.Thread(target=self._on_stop, name="on-stop", daemon=True)
            beside.start()
        live = [c for c in self.children.values() if c.popen is not None and c.popen.poll() is None]
        if live:
            self.log(f"stopping {', '.join(c.program.name for c in live)}")
        for child in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.popen.pid, child.program.stop_signal)  # type: ignore[union-attr]  # not its group
        deadline = time.monotonic() + self.stop_timeout
        for child in live:
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                name = signal.Signals(child.program.stop_signal).name
                self.log(f"{child.program.name} ignored {name} for {self.stop_timeout:g}s: SIGKILL")
        for child in self.children.values():
            if child.popen is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.popen.pid, signal.SIGKILL)  # stragglers in its group
            child.popen.wait()
            if child.reader is not None:
                child.reader.join(2)
        if beside is not None:
            beside.join()
        if self.state_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.state_file.unlink()
        if self.watchdog is not None:
            self._tell("done")  # a goodbye: nothing is left to stop
            with contextlib.suppress(OSError, ValueError):
                self.watchdog.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.watchdog.wait(5)


def _describe(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
    return f"code {returncode}"


def _has_fileno(stream: object) -> bool:
    try:
        stream.fileno()  # type: ignore[attr-defined]
        return True
    except (AttributeError, OSError, ValueError):
        return False


# ---- the watchdog ------------------------------------------------------------------------------


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def watchdog(lines: IO[str], on_orphan: Sequence[str], grace: float = 5.0) -> int:
    """Read the supervisor's lines (``+pgid``, ``-pgid``, ``done``); when they end without
    ``done`` the supervisor died: stop every group it had, then run ``on_orphan``."""
    groups: set[int] = set()
    for raw in lines:
        line = raw.strip()
        if line == "done":
            return 0
        if line[:1] in "+-" and line[1:].isdigit():
            (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
    stamp = time.strftime("%H:%M:%S")
    with contextlib.suppress(OSError, ValueError):  # its terminal may be gone (EIO)
        print(f"{stamp} watchdog | the supervisor died: stopping {len(groups)} program(s)", flush=True)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_group_alive(g) for g in groups):
        time.sleep(0.1)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    if on_orphan:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(list(on_orphan), timeout=120, check=False)
    return 1


def leftovers(state_file: Path) -> list[str]:
    """Programs of a previous supervisor (``state_file``) that still run, as sentences; empty
    when there is no such file or nothing of it lives."""
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return []
    found = []
    for name, info in sorted((state.get("programs") or {}).items()):
        try:
            proc = psutil.Process(int(info["pid"]))
            if abs(proc.create_time() - float(info["started"])) > 1:
                continue  # the pid was reused by something else
            command = " ".join(proc.cmdline())[:120]
        except (psutil.Error, KeyError, TypeError, ValueError):
            continue
        found.append(f"{name} (pid {info['pid']}: {command})")
    return found


if __name__ == "__main__":
    if sys.argv[1:2] != ["watchdog"]:
        sys.exit("usage: python -m catacloud.supervisor watchdog [ON_ORPHAN COMMAND...]")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # it ends when the supervisor's pipe does
    sys.exit(watchdog(sys.stdin, sys.argv[2:]))
