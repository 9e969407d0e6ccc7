"""A pytest plugin: the test run leaves nothing behind.

Every process the run starts carries ``CATACLOUD_TEST_SESSION=<this run>`` in its environment
(set here before any test runs, and inherited: workers, web, agent servers, agents, fakes, the
embedded PostgreSQL's postmaster); a local machine, whose environment is scrubbed, carries its
own mark naming its folder, and Redis, which writes over its environment, works in its data
folder: both in the run's folders (pytest's temporary ones and ``WATCHED_FOLDERS``). At the end
of the run, what still runs of those (each gets a few seconds to end first) is named, killed,
and fails the run.

The tests' ``conftest.py`` takes its hooks (a ``-p testkit.leftovers`` would need ``testkit`` on
the path before pytest reads the conftest); another run loads it with ``-p testkit.leftovers``.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from testkit.processes import SESSION_ENV, WATCHED_FOLDERS, leftovers_after

LEFTOVERS = pytest.StashKey[list[str]]()
STARTED = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    import psutil

    os.environ[SESSION_ENV] = uuid.uuid4().hex  # before any test starts a process
    config.stash[STARTED] = psutil.Process().create_time()  # (psutil's clock: whole-second boot time)


def _stop_own_resource_tracker() -> None:
    """End this process's multiprocessing resource tracker: a helper of pytest's own process
    (started when a test uses a spawn context, as the claim benchmark's smoke test does), which
    would end with pytest anyway; it is not a process a test left behind."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # the module's one instance
    if getattr(tracker, "_pid", None) is not None:
        tracker._stop()  # closes its pipe, waits for it: what pytest's exit does


@pytest.hookimpl(trylast=True)  # under pytest-xdist: once the workers are down
def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_own_resource_tracker()
    factory = getattr(session.config, "_tmp_path_factory", None)  # pytest's tmp_path plugin
    folders = [factory.getbasetemp(), *WATCHED_FOLDERS] if factory is not None else [*WATCHED_FOLDERS]
    left = leftovers_after(os.environ[SESSION_ENV], folders, session.config.stash[STARTED])
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its controller reports them
        workeroutput["leftovers"] = left
        return
    left = session.config.stash.get(LEFTOVERS, []) + left
    session.config.stash[LEFTOVERS] = left
    if left and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """A pytest-xdist worker is done: what its tests left (each worker checks its own
    processes, which carry its own session mark)."""
    left = getattr(node, "workeroutput", {}).get("leftovers", [])
    node.config.stash[LEFTOVERS] = node.config.stash.get(LEFTOVERS, []) + [
        f"[{node.gateway.id}] {x}" for x in left
    ]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    left = config.stash.get(LEFTOVERS, [])
    if left:
        title = "what the tests left running or mounted (ended now; the run fails)"
        terminalreporter.section(title, red=True)
        for line in left:
            terminalreporter.line(line, red=True)
