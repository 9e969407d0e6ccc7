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
- ``stop()`` (or SIGINT/SIGTERM when ``run`` is in the main thread) sends each program's
  ``stop_signal`` (SIGTERM unless it says otherwise) to its process group, waits up to
  ``stop_timeout`` seconds, then SIGKILLs what is left.

No Django here: ``catacloud/`` never imports it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO


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

    # ---- output ---------------------------------------------------------------------------------

    def log(self, message: str, name: str = "catacloud") -> None:
        stamp = time.strftime("%H:%M:%S")
        with self._write_lock:
            self.out.write(f"{stamp} {name.ljust(self._width)} | {message}\n")
            self.out.flush()

    def announce(self, text: str) -> None:
        """Write ``text`` as it is (no prefix), between the programs' lines."""
        with self._write_lock:
            self.out.write(text if text.endswith("\n") else text + "\n")
            self.out.flush()

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.log(raw.decode(errors="replace").rstrip("\n"), name)
        stream.close()

    # ---- processes --------------------------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        child = self.children[name]
        return child.popen.pid if child.popen is not None and child.popen.poll() is None else None

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
        assert child.popen.stdout is not None
        child.reader = threading.Thread(
            target=self._pump, args=(p.name, child.popen.stdout), name=f"out-{p.name}", daemon=True
        )
        child.reader.start()
        self.log(f"started {p.name} (pid {child.popen.pid})")

    def start(self) -> None:
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
            if child.restart_at is not None and now >= child.restart_at:
                self._start(child)
                self.log(f"restarted {child.program.name} (pid {child.popen.pid})")  # type: ignore[union-attr]

    def run(self) -> int:
        """Start everything and supervise until ``stop()`` or SIGINT/SIGTERM; then stop all."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, lambda *_: self._stopping.set())
        try:
            self.start()
            while not self._stopping.wait(self.poll_interval):
                self.check()
        finally:
            self._shutdown()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return 0

    def stop(self) -> None:
        self._stopping.set()

    def _shutdown(self) -> None:
        self._stopping.set()
        live = [c for c in self.children.values() if c.popen is not None and c.popen.poll() is None]
        if live:
            self.log(f"stopping {', '.join(c.program.name for c in live)}")
        for child in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.popen.pid, child.program.stop_signal)  # type: ignore[union-attr]
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


def _describe(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
    return f"code {returncode}"
