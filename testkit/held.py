"""Another transaction, on its own thread and connection, held open while a test acts: what a
concurrent request, heartbeat or job report looks like to the code under test at that instant."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Held:
    """``with Held(work):`` runs ``work()`` in a transaction on another thread (its own database
    connection) and keeps that transaction open, its locks held and its writes uncommitted, until
    the block ends (or ``commit()``); then it commits. ``error``: what ``work`` raised, if anything."""

    def __init__(self, work: Callable[[], Any], *, hold_for: float = 30) -> None:
        self.work, self.hold_for = work, hold_for
        self.held, self.release = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._hold)

    def _hold(self) -> None:
        from django.db import connection, transaction

        try:
            with transaction.atomic():
                self.work()
                self.held.set()
                self.release.wait(self.hold_for)
        except BaseException as exc:  # reported to the test (a thread's exception is otherwise lost)
            self.error = exc
        finally:
            self.held.set()
            connection.close()

    def commit(self) -> None:
        """Let the transaction commit, and wait until it has."""
        self.release.set()
        self.thread.join(self.hold_for)

    def __enter__(self) -> Held:
        self.thread.start()
        assert self.held.wait(10), "the other transaction did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self.commit()
