"""The console's home page, grouped as an operator looks for things: the fleet, jobs, costs, the
CI integrations, organizations and access, then the records and the system's own marks.

Django groups models by the app that defines them (budgets sat under Machines, heartbeats and the
installation under "Core" with nothing to say what they are). :func:`console_app_list` regroups
the same entries (the same permissions: a model the operator may not see is left out) into
:data:`MENU`, names the ones whose model name says little, and adds a line of help; a model
registered later that no group names keeps its app's own group at the end, so nothing is ever
hidden. An app's own page (``/admin/<app>/``) still lists that app's models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.admin import AdminSite
from django.http import HttpRequest
from django.urls import reverse


@dataclass(frozen=True)
class Entry:
    model: str  # "app_label.modelname"
    name: str = ""  # shown instead of the model's plural name
    help: str = ""


@dataclass(frozen=True)
class Link:
    """A console page that is not a model's list (shown with the group's first visible entry)."""

    url_name: str
    name: str
    help: str = ""


@dataclass(frozen=True)
class Group:
    key: str
    name: str
    entries: tuple[Entry | Link, ...]
    help: str = ""


@dataclass(frozen=True)
class AppGroup:
    """An app's own group, as Django lists it (its models in the app's order)."""

    app_label: str


MENU: tuple[Group | AppGroup, ...] = (
    Group(
        "fleet",
        "Fleet",
        (
            Entry(
                "machines.machineinstance",
                "Machines",
                "live, failed and lost; the status filter shows terminated ones",
            ),
            Entry("pools.instancepool", "Pools", "warm machines kept ready for jobs"),
            Entry(
                "machines.host",
                "Enrolled hosts",
                "machines users own, enrolled with a token: capacity, slots, cordon, drain, revoke",
            ),
            Entry("machines.enrolmenttoken", "Enrolment tokens", "what hosts enroll with (shown once)"),
            Entry("machines.machinetype"),
            Entry("machines.provideraccount"),
        ),
    ),
    Group(
        "work",
        "Jobs",
        (
            Entry("jobs.job"),
            Entry("jobs.jobconfiguration"),
            Entry(
                "resources.resourceinstance",
                "Managed resources",
                "tokens, databases and the like made for jobs",
            ),
            Entry("resources.resourcetype"),
        ),
    ),
    Group(
        "costs",
        "Costs",
        (
            Link(
                "admin:billing_cost_chart", "Cost per day", "per org: job, warm, idle and tail (paid, unused)"
            ),
            Entry("machines.budget", "Budgets", "money per org (or machine type) per day or month"),
        ),
    ),
    AppGroup("github"),
    AppGroup("gitlab"),
    Group(
        "access",
        "Organizations and access",
        (
            Entry("orgs.organization"),
            Entry("machines.orgmachinetype", "Machine type grants and quotas"),
            Entry("orgs.membership"),
            Entry("orgs.apitoken", "API tokens"),
            Entry("orgs.privilege"),
            Entry("auth.user"),
            Entry("auth.group"),
        ),
    ),
    Group(
        "records",
        "Records and the system",
        (
            Entry("events.event", "Events", "what happened, newest first (append-only)"),
            Entry(
                "core.heartbeat",
                "Service heartbeats",
                "when Celery beat's heartbeat and the reaper last ran (what /healthz reads)",
            ),
            Entry(
                "core.installation",
                "Installation identity",
                "this installation's id: the label on every cloud machine it owns (the reconciler "
                "touches no machine without it)",
            ),
        ),
    ),
)


def _models_by_label(apps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{app['app_label']}.{m['object_name'].lower()}": m for app in apps for m in app["models"]}


def _group(group: Group, models: dict[str, dict[str, Any]], placed: set[str]) -> dict[str, Any] | None:
    rows: list[dict[str, Any]] = []
    for entry in group.entries:
        if isinstance(entry, Entry) and entry.model in models:
            placed.add(entry.model)
            rows.append(
                {**models[entry.model], **({"name": entry.name} if entry.name else {}), "help": entry.help}
            )
    if not rows:
        return None  # nothing the operator may see
    links = [
        {
            "name": e.name,
            "object_name": e.url_name.rsplit("_", 1)[-1],
            "admin_url": reverse(e.url_name),
            "add_url": None,
            "view_only": True,
            "help": e.help,
        }
        for e in group.entries
        if isinstance(e, Link)
    ]
    return {
        "name": group.name,
        "app_label": group.key,
        "app_url": "",
        "help": group.help,
        "models": links + rows,
    }


def console_app_list(
    site: AdminSite, request: HttpRequest, app_label: str | None = None
) -> list[dict[str, Any]]:
    """The home page's groups (:data:`MENU`); for one app's page, Django's own list."""
    apps = AdminSite.get_app_list(site, request, app_label)
    if app_label is not None:
        return apps
    models = _models_by_label(apps)
    placed: set[str] = set()
    out = []
    for item in MENU:
        if isinstance(item, Group):
            built = _group(item, models, placed)
            if built is not None:
                out.append(built)
        else:
            out.extend(app for app in apps if app["app_label"] == item.app_label)
            placed.update(label for label in models if label.split(".")[0] == item.app_label)
    for app in apps:  # what no group names keeps its app's group, at the end
        rest = [m for m in app["models"] if f"{app['app_label']}.{m['object_name'].lower()}" not in placed]
        if rest:
            out.append({**app, "models": rest})
    return out
