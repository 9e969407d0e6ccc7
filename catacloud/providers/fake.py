"""An in-memory provider for tests: records calls, injects errors, never touches a cloud.

State lives at class level, keyed by the ``account`` config value, so every instance built
for the same account (e.g. one per Celery task) sees the same machines::

    FakeProvider.fail_next("create", InsufficientCapacity())          # raise before acting
    FakeProvider.fail_next("create", Transient(), after_effect=True)   # act, then lose the answer
    FakeProvider.calls_for("acct")                                     # [Call("create", ...), ...]
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import threading
from collections import deque
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar

from catacloud.providers.base import (
    LABEL_INSTANCE,
    MachineSpec,
    MachineState,
    NotFound,
    Provider,
    ProviderError,
    ProviderMachine,
)

ANY_ACCOUNT = "*"
METHODS = ("create", "get", "list", "delete")


@dataclasses.dataclass(frozen=True)
class Call:
    method: str
    account: str
    arg: Any


@dataclasses.dataclass
class _Failure:
    error: ProviderError
    after_effect: bool


@dataclasses.dataclass
class _Account:
    machines: dict[str, ProviderMachine] = dataclasses.field(default_factory=dict)
    specs: dict[str, MachineSpec] = dataclasses.field(default_factory=dict)
    calls: list[Call] = dataclasses.field(default_factory=list)


class FakeProvider(Provider):
    """Config: ``account`` (default ``"default"``), ``initial_state`` (raw state of new machines,
    default ``"running"``; use ``"provisioning"`` to see warming)."""

    kind = "fake"
    STATE_MAP: ClassVar[Mapping[str, MachineState]] = {
        "provisioning": MachineState.PROVISIONING,
        "running": MachineState.RUNNING,
        "stopping": MachineState.STOPPING,
        "gone": MachineState.GONE,
        "error": MachineState.ERROR,
    }

    _lock: ClassVar[threading.RLock] = threading.RLock()
    _accounts: ClassVar[dict[str, _Account]] = {}
    _failures: ClassVar[dict[tuple[str, str], deque[_Failure]]] = {}
    _ids: ClassVar[itertools.count[int]] = itertools.count(1)

    def __init__(self, *, config: Mapping[str, Any], credentials: Mapping[str, str]) -> None:
        super().__init__(config=config, credentials=credentials)
        self.account = str(self.config.get("account", "default"))
        self.initial_state = str(self.config.get("initial_state", "running"))
        if self.initial_state not in self.STATE_MAP:
            raise ValueError(f"initial_state must be one of {sorted(self.STATE_MAP)}")

    # ---- test controls ------------------------------------------------------------------------

    @classmethod
    def fail_next(
        cls,
        method: str,
        error: ProviderError,
        *,
        times: int = 1,
        account: str | None = None,
        after_effect: bool = False,
    ) -> None:
        """Make the next ``times`` calls of ``method`` raise ``error``.

        With ``after_effect`` the call does its work first (the machine is created or deleted)
        and then raises: a response lost on the way back.
        """
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}")
        with cls._lock:
            queue = cls._failures.setdefault((account or ANY_ACCOUNT, method), deque())
            queue.extend(_Failure(error, after_effect) for _ in range(times))

    @classmethod
    def reset(cls, account: str | None = None) -> None:
        """Forget machines, calls and pending failures (of one account, or of all)."""
        with cls._lock:
            if account is None:
                cls._accounts.clear()
                cls._failures.clear()
            else:
                cls._accounts.pop(account, None)
                for key in [k for k in cls._failures if k[0] == account]:
                    del cls._failures[key]

    @classmethod
    def calls_for(cls, account: str = "default", method: str | None = None) -> list[Call]:
        with cls._lock:
            calls = list(cls._state(account).calls)
        return [c for c in calls if method is None or c.method == method]

    @classmethod
    def machines_of(cls, account: str = "default") -> list[ProviderMachine]:
        """Every machine the fake cloud holds for ``account`` (whatever its state)."""
        with cls._lock:
            return list(cls._state(account).machines.values())

    @classmethod
    def set_state(cls, provider_id: str, raw_state: str, *, account: str = "default") -> None:
        """Move a machine to another raw state (e.g. ``"running"`` after warming)."""
        with cls._lock:
            state = cls._state(account)
            machine = state.machines[provider_id]
            state.machines[provider_id] = dataclasses.replace(
                machine, raw_state=raw_state, state=cls.map_state(raw_state)
            )

    @classmethod
    def vanish(cls, provider_id: str, *, account: str = "default") -> None:
        """The provider loses the machine behind our back (spot reclaim, manual deletion)."""
        with cls._lock:
            cls._state(account).machines.pop(provider_id, None)

    # ---- the interface ------------------------------------------------------------------------

    def create(self, spec: MachineSpec) -> ProviderMachine:
        failure = self._begin("create", spec)
        with self._lock:
            state = self._state(self.account)
            machine = next(
                (m for m in state.machines.values() if m.instance_id == spec.instance_id and m.alive), None
            )
            if machine is None:
                provider_id = f"fake-{next(self._ids)}"
                machine = ProviderMachine(
                    provider_id=provider_id,
                    name=spec.name,
                    state=self.map_state(self.initial_state),
                    labels={**spec.labels, LABEL_INSTANCE: spec.instance_id},
                    created_at=datetime.now(UTC),
                    public_ip="192.0.2.1",
                    raw_state=self.initial_state,
                )
                state.machines[provider_id] = machine
                state.specs[provider_id] = spec
        self._end(failure)
        return machine

    def get(self, provider_id: str) -> ProviderMachine:
        failure = self._begin("get", provider_id)
        with self._lock:
            machine = self._state(self.account).machines.get(provider_id)
        self._end(failure)
        if machine is None:
            raise NotFound(f"no machine {provider_id}")
        return machine

    def list(self, owner_labels: Mapping[str, str]) -> list[ProviderMachine]:
        failure = self._begin("list", dict(owner_labels))
        with self._lock:
            found = [
                m
                for m in self._state(self.account).machines.values()
                if m.state is not MachineState.GONE and owner_labels.items() <= m.labels.items()
            ]
        self._end(failure)
        return found

    def delete(self, provider_id: str) -> None:
        failure = self._begin("delete", provider_id)
        with self._lock:
            state = self._state(self.account)
            state.machines.pop(provider_id, None)
            state.specs.pop(provider_id, None)
        self._end(failure)

    # ---- helpers ------------------------------------------------------------------------------

    @classmethod
    def _state(cls, account: str) -> _Account:
        return cls._accounts.setdefault(account, _Account())

    def _begin(self, method: str, arg: Any) -> _Failure | None:
        """Record the call; raise an injected failure now, or return it to raise after the effect."""
        with self._lock:
            self._state(self.account).calls.append(Call(method, self.account, arg))
            failure = None
            for key in ((self.account, method), (ANY_ACCOUNT, method)):
                queue = self._failures.get(key)
                if queue:
                    failure = queue.popleft()
                    break
        if failure is not None and not failure.after_effect:
            raise copy.copy(failure.error)
        return failure

    @staticmethod
    def _end(failure: _Failure | None) -> None:
        if failure is not None:
            raise copy.copy(failure.error)
