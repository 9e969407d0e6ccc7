"""A forge, as the CI core sees it: what one adapter (apps.github, apps.gitlab) tells the core
about itself (:class:`Forge`: its tables, its statuses, its events, its tasks) and what it does
at its forge (:class:`ForgeOps`: authenticate and parse, create, hand over, list and delete a
runner, find lost deliveries). The core (demand, dispatch, records, the reconciler,
availability, the request budget, intake) is written once against these.

The adapters sit above the core (pyproject.toml's layers), so they are made known to it in the
one place upward calls are wired, ``apps/control/wiring.py`` (:func:`register`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, TypeAlias
from uuid import UUID

from apps.ci.choices import Applied, Handoff
from apps.core.actors import Actor
from apps.core.causes import Cause
from apps.events.kinds import EventKind

EndpointId: TypeAlias = UUID  # our row of an endpoint (installation, connection), not the forge's id
RunnerClassId: TypeAlias = UUID
RunnerId: TypeAlias = UUID  # a runner's row: the id of the Catacloud job it is
Model: TypeAlias = Any  # one of the forge's concrete models (their fields differ by forge)
ForgeClient: TypeAlias = Any  # the forge's client (apps.ci.client.ForgeClient, subclassed)


@dataclass(frozen=True)
class StatusRules:
    """A forge's job statuses: records move to a higher rank only; among the statuses of
    ``pending`` (not started, one rank) any move is allowed (a reordered pair is corrected by
    the reconciler's poll within one interval)."""

    rank: Mapping[str, int]
    pending: frozenset[str]
    demand: str  # the status a runner is started for (GitHub: queued; GitLab: pending)
    started: frozenset[str]  # statuses that name the runner that took the job
    done: frozenset[str]
    events: Mapping[str, EventKind]  # the event a move to this status records (none: not listed)

    @property
    def unfinished(self) -> list[str]:
        return sorted(s for s in self.rank if s not in self.done)


@dataclass(frozen=True)
class ForgeEvents:
    job_seen: EventKind  # a job one of the org's classes covers, seen the first time
    runner_registered: EventKind
    runner_refused: EventKind
    runner_deleted: EventKind
    runner_recycled: EventKind
    unavailable: EventKind
    available: EventKind
    rate_limited: EventKind  # a limit answer, or our pacing holding registrations
    class_created: EventKind
    class_updated: EventKind
    class_deleted: EventKind
    runner_outdated: EventKind | None = None  # a runner refused to start: too old for the forge


@dataclass(frozen=True)
class ForgeTasks:
    """The forge's Celery tasks, by name (services send them by name)."""

    handoff: str
    retire: str
    converge: str
    reconcile: str
    finished: str = ""  # a runner that took its job is deleted at the forge at once (GitLab)


@dataclass(frozen=True)
class ForgeSettings:
    """The names of the forge's settings (CATACLOUD_<FORGE>_...)."""

    reconcile_interval: str
    request_budget: str
    timeout: str


@dataclass(frozen=True)
class Forge:
    name: str  # "github": the runner jobs' handoff_by, the job configurations' prefix
    title: str  # "GitHub": in reasons and logs
    endpoint: Model  # the endpoint model (GitHubInstallation, GitLabConnection)
    runner_class: Model
    ci_job: Model  # the forge's job records (WorkflowJob, GitLabJob)
    runner: Model
    delivery: Model
    # Field names that differ by forge: the endpoint's foreign key on jobs, runners and
    # deliveries; a runner's bound job; a runner's id at the forge; Job -> runner.
    endpoint_field: str
    bound_field: str
    runner_id_field: str
    job_relation: str
    labels_field: str  # the runner class's labels (GitHub) or tags (GitLab)
    endpoint_related: tuple[str, ...]  # select_related() to reach the endpoint's credentials
    statuses: StatusRules
    events: ForgeEvents
    tasks: ForgeTasks
    settings: ForgeSettings
    actor: Actor
    reconciler_actor: Actor
    actor_for: Callable[[str], Actor]  # a part of the integration (webhook, poll)
    unavailable_cause: Cause
    refused_cause: Cause
    unavailable_outcome: Handoff
    generic_labels: frozenset[str] = field(default_factory=frozenset)
    manager_field: str = ""  # a runner's runner-manager field (GitLab: system_id), if any

    def __str__(self) -> str:
        return self.name

    def endpoint_of(self, row: Model) -> Any:
        return getattr(row, self.endpoint_field)

    def runner_id_of(self, runner: Model) -> int | None:
        value = getattr(runner, self.runner_id_field)
        return int(value) if value is not None else None

    def bound_id_of(self, runner: Model) -> Any:
        return getattr(runner, f"{self.bound_field}_id")

    def unbound(self) -> dict[str, Any]:
        """Filter: runners not given a job yet."""
        return {f"{self.bound_field}__isnull": True}

    def of_endpoint(self, endpoint: Any) -> dict[str, Any]:
        return {self.endpoint_field: endpoint}


@dataclass(frozen=True)
class Registration:
    """A runner created at the forge for one machine: what the agent gets (``secret_env``: the
    secret, never logged, never returned by our API, erased when the job ends). ``fields``: more
    of the runner's row (GitLab's class runner mode: its runner manager's system id);
    ``shared``: the runner serves the class's other machines too (never deleted for this job;
    its online state is not the forge's to tell per machine, so it counts as online)."""

    runner_id: int
    name: str
    secret_env: dict[str, str]
    fields: dict[str, Any] = field(default_factory=dict)
    shared: bool = False

    def __repr__(self) -> str:  # a stray log line must not print the secret
        return f"Registration(runner_id={self.runner_id}, name={self.name!r})"


@dataclass(frozen=True)
class Listed:
    """A runner the forge lists: its id, name, where it is registered (what deleting it needs),
    whether it is online (it connected) and busy (running a job; None: the forge does not say)."""

    runner_id: int
    name: str
    where: str
    online: bool
    busy: bool | None


@dataclass(frozen=True)
class JobReport:
    """One forge job as a delivery or the forge's API told it, parsed by the adapter."""

    key: dict[str, Any]  # the record's key fields ({github_id, run_attempt}, {gitlab_id})
    status: str
    labels: list[str]
    create: dict[str, Any]  # the fields of a new record (repository, names, labels)
    runner_name: str = ""
    runner_id: int | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    conclusion: str = ""
    update: dict[str, Any] = field(default_factory=dict)  # forge fields a move also writes
    runner_manager: str = ""  # the runner manager (GitLab's system id) when the forge names it


class ForgeOps(Protocol):
    """What an adapter does at its forge. Every call goes through the forge's one client."""

    def client(self, endpoint: Any) -> ForgeClient: ...

    def runner_env(self, record: Any) -> dict[str, str]:
        """Plain env of a runner job started for ``record`` (e.g. the forge's URL)."""
        ...

    def register(self, client: ForgeClient, runner: Any, name: str) -> Registration:
        """Create a runner named ``name`` for the machine of ``runner``'s job."""
        ...

    def delete(self, client: ForgeClient, runner: Any, runner_id: int, *, background: bool = False) -> bool:
        """Delete a registered runner of ours; False when it was already gone."""
        ...

    def retire(self, client: ForgeClient, runner: Any) -> bool:
        """Delete an idle runner no longer needed; :class:`ForgeBusy` when it runs a job."""
        ...

    def listed(self, client: ForgeClient, endpoint: Any) -> dict[int, Listed]:
        """The runners registered where the endpoint's runners register (ours and others)."""
        ...

    def delete_listed(self, client: ForgeClient, listed: Listed) -> bool: ...

    def poll(self, forge: Forge, client: ForgeClient, endpoint: Any) -> tuple[int, set[tuple[Any, ...]], Any]:
        """Pending and running jobs we may have missed: (how many were news, the keys of the jobs
        it listed, and a ``Q`` of our records it would have listed were they still so: those of
        them it did not list have moved on without us hearing, and are looked up)."""
        ...

    def key_of(self, record: Any) -> tuple[Any, ...]: ...

    # The fields of a job record (or through a runner's created_for) that decide which runners
    # can take it; :meth:`scope_of` names the scope from their values ("" for runners of the
    # class's organization or group, which take any of its jobs).
    scope_fields: tuple[str, ...]

    def scope_of(self, runner_class: Any, values: Mapping[str, Any]) -> str:
        """The scope of a job whose ``scope_fields`` have ``values``: a repository or project its
        runner registers in (and serves alone), or "" (any job of the class)."""
        ...

    def look_up(self, forge: Forge, client: ForgeClient, record: Any) -> Applied:
        """A record the poll did not list: its job as the forge says it now, applied."""
        ...

    def reconcile_extra(
        self, forge: Forge, client: ForgeClient, endpoint: Any, now: datetime
    ) -> dict[str, int]:
        """Anything else the forge's reconcile does (GitHub: redeliver failed deliveries)."""
        ...

    def act(self, forge: Forge, delivery: Any, hint: Mapping[str, Any] | None) -> str | None:
        """Act on a stored delivery (inside its transaction; no forge call). None: it needs
        a forge call first (the adapter sent the task that makes it and acts then)."""
        ...

    def check_class(self, runner_class: Any) -> None:
        """Refuse a runner class the forge cannot serve (ValidationFailed)."""
        ...

    def outdated(self, exit_code: int) -> str:
        """Why a runner job that failed with ``exit_code`` says its runner is a version the forge
        no longer accepts (its class is then blocked), or "" (an ordinary failure)."""
        ...

    def class_config(self, runner_class: Any) -> dict[str, Any]:
        """The job configuration fields the class's runner jobs need (command, image)."""
        ...


_FORGES: dict[str, tuple[Forge, ForgeOps]] = {}


def register(forge: Forge, ops: ForgeOps) -> None:
    """Make a forge known to the core (apps/control/wiring.py)."""
    _FORGES[forge.name] = (forge, ops)


def forges() -> list[Forge]:
    return [forge for forge, _ in _FORGES.values()]


def forge_named(name: str) -> Forge | None:
    found = _FORGES.get(name)
    return found[0] if found else None


def ops_of(forge: Forge) -> ForgeOps:
    try:
        return _FORGES[forge.name][1]
    except KeyError:
        raise LookupError(f"forge {forge.name!r} is not registered: is apps.control installed?") from None


def registered(names: Iterable[str]) -> bool:
    return all(name in _FORGES for name in names)
