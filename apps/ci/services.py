"""Runner classes, as every forge keeps them: labels (GitHub) or tags (GitLab) -> machine type,
pool, timeouts, command, through a job configuration the class keeps (``<forge>-<name>``:
same admission, quotas, budgets, priorities and reports as any job). The one write path for
the API, the admin console and the catalog; the forge checks what it alone knows
(:meth:`apps.ci.forge.ForgeOps.check_class`) and says how its runners run
(:meth:`~apps.ci.forge.ForgeOps.class_config`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.db.models import Model

from apps.ci.forge import Forge, ops_of
from apps.core.actors import Actor
from apps.core.errors import Conflict, ErrorCode, NotFound, ValidationFailed
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.jobs.choices import JOB_LIVE, Reuse
from apps.jobs.models import JobConfiguration
from apps.jobs.services import job_config_delete, job_config_save
from apps.machines.models import MachineType
from apps.orgs.models import Organization
from apps.pools.models import InstancePool

MAX_LABELS = 100


def invalid(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def normalise_labels(labels: Any, field: str = "labels", *, limit: int = 255) -> list[str]:
    """1-100 labels (tags), lower-case, unique, sorted, each at most ``limit`` characters."""
    if not isinstance(labels, list | tuple) or not labels:
        raise invalid(field, f"must be a list of 1 to 100 {field}")
    out = set()
    for label in labels:
        if not isinstance(label, str) or not label.strip() or len(label) > limit:
            raise invalid(field, f"each label is a non-empty string of at most {limit} characters")
        out.add(label.strip().lower())
    if len(out) > MAX_LABELS:
        raise invalid(field, f"at most {MAX_LABELS} labels")
    return sorted(out)


@transaction.atomic
def runner_class_save(
    *,
    forge: Forge,
    org: Organization,
    fields_allowed: tuple[str, ...],
    runner_class: Any = None,
    actor: Actor = Actor.UNNAMED,
    label_limit: int = 255,
    **fields: Any,
) -> tuple[Any, bool]:
    """Create (``runner_class`` None) or change a runner class and the job configuration it
    keeps (machine type, command, timeout, priority, attempts; reuse, so a machine serves the
    class's next runner while its paid period lasts). Returns (class, changed)."""
    unknown = set(fields) - set(fields_allowed)
    if unknown:
        raise ValidationFailed(f"unknown fields: {', '.join(sorted(unknown))}")
    labels_field = forge.labels_field
    creating = runner_class is None
    rc = runner_class or forge.runner_class(org=org)
    before = {k: getattr(rc, k) for k in fields_allowed} if not creating else {}
    if labels_field in fields:
        fields[labels_field] = normalise_labels(fields[labels_field], labels_field, limit=label_limit)
    for key, value in fields.items():
        setattr(rc, key, value)
    if not rc.name:
        raise invalid("name", "required")
    if not getattr(rc, labels_field):
        raise invalid(labels_field, "required")
    ops = ops_of(forge)
    ops.check_class(rc)
    if not isinstance(rc.machine_type, MachineType):
        raise invalid("machine_type", "required")
    if rc.pool is not None and (rc.pool.org_id != org.pk or rc.pool.machine_type_id != rc.machine_type.pk):
        raise invalid("pool", "must be a pool of this organization with the class's machine type")
    clash = forge.runner_class.objects.filter(org=org).exclude(pk=rc.pk)
    if clash.filter(name=rc.name).exists():
        raise ValidationFailed(
            f"a runner class named {rc.name!r} already exists",
            fields={"name": ["already exists"]},
            code=ErrorCode.DUPLICATE_NAME,
        )
    if any(sorted(getattr(c, labels_field)) == getattr(rc, labels_field) for c in clash):
        raise ValidationFailed(
            f"another runner class has these {labels_field}",
            fields={labels_field: ["already used"]},
            code=ErrorCode.DUPLICATE_NAME,
        )
    after = {k: getattr(rc, k) for k in fields_allowed}
    if not creating and after == before:
        return rc, False
    rc.blocked_at, rc.blocked_reason = None, ""  # changed (its runner updated): runners start again
    config_fields: dict[str, Any] = {
        "name": f"{forge.name}-{rc.name}",
        "machine_type": rc.machine_type,
        "timeout_seconds": rc.timeout_seconds,
        "priority": rc.priority,
        "max_attempts": rc.max_attempts,
        "reuse": Reuse.REUSE,
        **ops.class_config(rc),
    }
    config = JobConfiguration.objects.filter(pk=rc.job_config_id).first() if rc.job_config_id else None
    rc.job_config = job_config_save(org=org, config=config, actor=actor, **config_fields)
    rc.save()
    event_record(
        kind=forge.events.class_created if creating else forge.events.class_updated,
        org=org,
        actor=actor,
        runner_class=rc.name,
        **{labels_field: getattr(rc, labels_field)},
        machine_type=rc.machine_type.name,
        fields=sorted(k for k in fields_allowed if creating or before.get(k) != after[k]),
    )
    return rc, True


@transaction.atomic
def runner_class_delete(*, forge: Forge, runner_class: Any, actor: Actor = Actor.UNNAMED) -> None:
    """Delete a class with no live runner (409 ``in_use`` otherwise); its job configuration
    goes too unless jobs refer to it (their records stay)."""
    if forge.runner.objects.filter(runner_class=runner_class, job__status__in=JOB_LIVE).exists():
        raise Conflict(
            f"runner class {runner_class.name} has live runners; cancel them first", code=ErrorCode.IN_USE
        )
    config = runner_class.job_config
    event_record(
        kind=forge.events.class_deleted,
        org=runner_class.org_id,
        actor=actor,
        runner_class=runner_class.name,
    )
    runner_class.delete()
    if config is not None and not config.jobs.exists():
        job_config_delete(config=config, actor=actor)


def has_live_runners(forge: Forge, **where: Any) -> bool:
    return forge.runner.objects.filter(**where, job__status__in=JOB_LIVE).exists()


def connection_locked(
    model: type[Model], *, org: Organization, title: str, required: dict[str, Any], **new: Any
) -> tuple[Any, bool]:
    """The org's connection, locked for a change; or, when it has none, a new one (``new``'s
    values, not saved yet), for which every value of ``required`` must be given (None or an
    empty string is missing; a bad value is the caller's check): a 400 naming the missing ones.
    Returns (connection, creating)."""
    conn = model._default_manager.select_for_update(no_key=True).filter(org=org).first()
    if conn is not None:
        return conn, False
    missing = [name for name, value in required.items() if value is None or value == ""]
    if missing:
        names = list(required)
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        raise ValidationFailed(
            f"a new {title} connection needs {listed}", fields={name: ["required"] for name in missing}
        )
    return model(org=org, **new), True


def _secrets_replace(conn: Any, given: dict[str, str | None], *, creating: bool) -> list[str]:
    """The secrets given (None keeps the stored one) replace the connection's; returns the names
    of those that changed (named in events, never shown). The caller checked their values."""
    stored = {} if creating else conn.secrets
    secrets = {**stored, **{name: value for name, value in given.items() if value is not None}}
    if secrets != stored:
        conn.secrets = secrets
    return [name for name in given if secrets.get(name) != stored.get(name)]


def connection_saved(
    conn: Any,
    *,
    org: Organization,
    actor: Actor,
    creating: bool,
    changed: list[str],
    secrets: dict[str, str | None],
    children: Callable[[], list[str]] | None,
    events: tuple[EventKind, EventKind],
    describe: dict[str, Any],
) -> tuple[Any, bool]:
    """The end of a connection's create-or-change, once the forge checked what it was given and
    set its fields (``changed`` names those that changed): the ``secrets`` given (None keeps the
    stored one) replace the stored ones; the row is saved when anything changed; ``children``
    (given when the caller was asked to: it brings the forge's installations or projects to
    the list asked for, :func:`children_set`) runs once the row is saved; then the event of the
    creation (``events[0]``) or change (``events[1]``, only when something did), naming the
    fields, never a value. Returns (connection, changed)."""
    changed = [*changed, *_secrets_replace(conn, secrets, creating=creating)]
    if changed or creating:
        conn.save()
    if children is not None:
        changed += children()
    if changed or creating:
        event_record(
            kind=events[0] if creating else events[1],
            org=org,
            actor=actor,
            **describe,
            fields=sorted(set(changed)),
        )
    return conn, bool(changed) or creating


def children_set(
    *,
    forge: Forge,
    conn: Any,
    relation: str,
    key: str,
    label: str,
    wanted: list[tuple[int, str]],
    same_forge: dict[str, Any],
    live_where: Callable[[Any], dict[str, Any]],
    keep_label_when_empty: bool = False,
) -> list[str]:
    """Bring a connection's children (GitHub's installations, GitLab's projects: ``relation``,
    each with its forge id ``key`` and a ``label``) to ``wanted`` (``(id, label)`` pairs). One
    connected to another organization on the same forge (``same_forge``) is a 409; one removed
    while runners of it live (``live_where(row)``) is a 409. Returns what changed (named)."""
    what = relation.removesuffix("s")
    manager = getattr(conn, relation)
    model = manager.model
    ids = {i for i, _ in wanted}
    clash = (
        model.objects.filter(**{f"{key}__in": ids}, **same_forge)
        .exclude(connection=conn)
        .values_list(key, flat=True)
        .first()
    )
    if clash is not None:
        raise Conflict(f"{what} {clash} is connected to another organization", code=ErrorCode.IN_USE)
    changed = []
    existing = {getattr(row, key): row for row in manager.all()}
    for ident, text in wanted:
        row = existing.get(ident)
        if row is None:
            model.objects.create(connection=conn, org_id=conn.org_id, **{key: ident, label: text})
            changed.append(relation)
        elif (text or not keep_label_when_empty) and getattr(row, label) != text:
            model.objects.filter(pk=row.pk).update(**{label: text})
            changed.append(relation)
    for ident, row in existing.items():
        if ident in ids:
            continue
        if has_live_runners(forge, **live_where(row)):
            raise Conflict(f"{what} {ident} still has live runners", code=ErrorCode.IN_USE)
        row.delete()
        changed.append(relation)
    return changed


@transaction.atomic
def connection_delete(
    *,
    forge: Forge,
    model: type[Model],
    org: Organization,
    actor: Actor,
    event: EventKind,
    live_where: Callable[[Any], dict[str, Any]],
    describe: Callable[[Any], dict[str, Any]],
) -> None:
    """Delete the org's connection to ``forge`` (409 ``in_use`` while runners of it live); the
    ``event`` names it (``describe``), never a secret."""
    conn = model._default_manager.select_for_update(no_key=True).filter(org=org).first()
    if conn is None:
        raise NotFound(f"this organization has no {forge.title} connection")
    if has_live_runners(forge, **live_where(conn)):
        raise Conflict(
            f"the {forge.title} connection still has live runners; cancel them first", code=ErrorCode.IN_USE
        )
    event_record(kind=event, org=org, actor=actor, **describe(conn))
    conn.delete()


def pool_by_name(org: Organization, name: str | None) -> InstancePool | None:
    if not name:
        return None
    pool = InstancePool.objects.filter(org=org, name=name).first()
    if pool is None:
        raise invalid("pool", f"no pool named {name!r}")
    return pool
