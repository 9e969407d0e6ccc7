"""The operator's declarative catalog: ``manage.py apply FILE.yaml``.

Provider accounts, privileges, machine types, organizations with members and grants (and
resource types), kept in git and applied idempotently and atomically: a bad file changes
nothing and names the line that is wrong; applying the same file twice changes nothing the
second time. Credentials are never inline: each value is ``{env: NAME}`` or ``{file: PATH}``.
Machine types of a Hetzner, AWS or Azure account are checked against what that account can buy
(apps/control/offerings.py) before anything is written.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml
from django.db import transaction

from apps.billing.budgets import budget_set
from apps.control.offerings import AccountOfferings, OfferingsUnchecked, checks_offerings, offerings_check
from apps.control.services import grant_upsert
from apps.core.actors import Actor
from apps.core.errors import DomainError
from apps.github.models import GitHubConnection, RunnerClass
from apps.github.services import CLASS_FIELDS, connection_set, pool_by_name, runner_class_save
from apps.gitlab import services as gitlab_services
from apps.gitlab.models import GitLabConnection, GitLabRunnerClass
from apps.machines.agent_dist import agent_wheel
from apps.machines.models import Budget, MachineType, OrgMachineType, ProviderAccount
from apps.machines.services import machine_type_upsert, provider_account_upsert
from apps.orgs.models import Organization, Privilege
from apps.orgs.services import membership_set, privilege_grant, user_get_or_create
from apps.resources.choices import WellKind
from apps.resources.models import ResourceType
from catacloud.providers import Offering


class CatalogError(Exception):
    def __init__(self, message: str, line: int | None = None, source: str = "") -> None:
        where = f"{source}:{line}: " if line else (f"{source}: " if source else "")
        super().__init__(f"{where}{message}")
        self.line = line


class _Map(dict):
    """A mapping that remembers the line it starts on and each key's line (1-based)."""

    line: int = 0
    key_lines: dict[str, int]


class _LineLoader(yaml.SafeLoader):
    def construct_mapping(self, node: Any, deep: bool = False) -> _Map:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise CatalogError(f"duplicate key {key!r}", key_node.start_mark.line + 1)
            seen[key] = key_node.start_mark.line + 1
        data = _Map(super().construct_mapping(node, deep=True))
        data.line = node.start_mark.line + 1
        data.key_lines = seen
        return data


def _construct_map(loader: _LineLoader, node: Any) -> _Map:
    return loader.construct_mapping(node)


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)


@dataclass
class Report:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, what: str, changed: bool, created: bool = False) -> None:
        (self.created if created else self.updated if changed else self.unchanged).append(what)

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated)

    def summary(self) -> str:
        return f"{len(self.created)} created, {len(self.updated)} updated, {len(self.unchanged)} unchanged"


SECTIONS = ("provider_accounts", "privileges", "machine_types", "resource_types", "organizations")


class _Applier:
    def __init__(self, source: str) -> None:
        self.source = source
        self.report = Report()
        # what each Hetzner, AWS or Azure account is asked for, by account name
        self.offerings: dict[str, AccountOfferings] = {}

    # ---- helpers ----------------------------------------------------------------------------

    def error(self, message: str, node: Any, key: str | None = None) -> CatalogError:
        line = None
        if isinstance(node, _Map):
            line = node.key_lines.get(key, node.line) if key else node.line
        return CatalogError(message, line, self.source)

    def mapping(self, node: Any, what: str, parent: Any = None, key: str | None = None) -> _Map:
        if not isinstance(node, _Map):
            raise self.error(f"{what} must be a mapping", parent, key)
        return node

    def items(self, doc: _Map, key: str) -> list[_Map]:
        value = doc.get(key) or []
        if not isinstance(value, list):
            raise self.error(f"{key} must be a list", doc, key)
        return [self.mapping(v, f"each entry of {key}", doc, key) for v in value]

    def fields(self, node: _Map, what: str, required: set[str], optional: set[str]) -> None:
        missing = required - set(node)
        if missing:
            raise self.error(f"{what} is missing {', '.join(sorted(missing))}", node)
        unknown = set(node) - required - optional
        if unknown:
            key = sorted(unknown)[0]
            raise self.error(f"{what}: unknown field {key!r}", node, key)

    def guard(self, node: _Map, fn: Callable[[], Any]) -> Any:
        """Run a service, turning its domain errors into errors at this entry's line."""
        try:
            return fn()
        except DomainError as exc:
            fields = getattr(exc, "fields", {}) or {}
            key = next((k for k in fields if k in node), None)
            raise self.error(exc.detail, node, key) from None

    def named_machine_type(self, node: _Map) -> MachineType:
        """The machine type ``node`` names under ``machine_type``; an error at that key if none."""
        mt = MachineType.objects.filter(name=str(node["machine_type"]), org__isnull=True).first()
        if mt is None:
            raise self.error(f"unknown machine type {node['machine_type']!r}", node, "machine_type")
        return mt

    def runner_class(
        self,
        org: Any,
        entry: _Map,
        *,
        model: type[RunnerClass] | type[GitLabRunnerClass],
        save: Callable[..., Any],
        what: str,
    ) -> None:
        """Create or update one runner class of a forge (GitHub's or GitLab's, by ``model`` and
        its service ``save``), in the pool and of the machine type the entry names."""
        mt = self.named_machine_type(entry)
        fields = {k: v for k, v in entry.items() if k not in ("machine_type", "pool")}
        existing = model.objects.filter(org=org, name=str(entry["name"])).first()
        pool = self.guard(entry, functools.partial(pool_by_name, org, entry.get("pool")))
        _, changed = self.guard(
            entry,
            functools.partial(
                save,
                org=org,
                runner_class=existing,
                actor=Actor.CATALOG,
                machine_type=mt,
                pool=pool,
                **fields,
            ),
        )
        self.report.add(f"{what} {org.slug}/{entry['name']}", changed, created=existing is None)

    def secret_ref(self, node: Any, parent: _Map, key: str) -> str:
        if not isinstance(node, _Map) or set(node) not in ({"env"}, {"file"}):
            raise self.error(
                f"credential {key!r} must be a reference, {{env: NAME}} or {{file: PATH}}; "
                "secrets are never written inline",
                parent,
                key,
            )
        if "env" in node:
            value = os.environ.get(str(node["env"]))
            if value is None:
                raise self.error(
                    f"credential {key!r}: environment variable {node['env']} is not set", parent, key
                )
            return value
        path = Path(str(node["file"])).expanduser()
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise self.error(f"credential {key!r}: cannot read {path}: {exc.strerror}", parent, key) from None

    # ---- sections ---------------------------------------------------------------------------

    def apply(self, doc: _Map) -> Report:
        unknown = set(doc) - set(SECTIONS)
        if unknown:
            key = sorted(unknown)[0]
            raise self.error(f"unknown section {key!r}; known: {', '.join(SECTIONS)}", doc, key)
        for entry in self.items(doc, "provider_accounts"):
            self.provider_account(entry)
        for entry in self.items(doc, "privileges"):
            self.privilege(entry)
        for entry in self.items(doc, "machine_types"):
            self.machine_type(entry)
        for entry in self.items(doc, "resource_types"):
            self.resource_type(entry)
        for entry in self.items(doc, "organizations"):
            self.organization(entry)
        return self.report

    def provider_account(self, node: _Map) -> None:

        self.fields(node, "provider account", {"name", "kind"}, {"config", "credentials"})
        config = node.get("config") or {}
        if not isinstance(config, dict):
            raise self.error("config must be a mapping", node, "config")
        creds_node = node.get("credentials")
        credentials = None
        if creds_node is not None:
            creds_node = self.mapping(creds_node, "credentials", node, "credentials")
            credentials = {k: self.secret_ref(v, creds_node, k) for k, v in creds_node.items()}
        existed = ProviderAccount.objects.filter(name=node["name"], org__isnull=True).exists()
        _, changed = self.guard(
            node,
            lambda: provider_account_upsert(
                name=str(node["name"]), kind=str(node["kind"]), config=dict(config), credentials=credentials
            ),
        )
        self.report.add(f"provider account {node['name']}", changed, created=not existed)

    def privilege(self, node: _Map) -> None:

        self.fields(node, "privilege", {"name"}, {"description"})
        privilege, created = Privilege.objects.get_or_create(
            name=str(node["name"]), defaults={"description": str(node.get("description", ""))}
        )
        changed = created
        if not created and privilege.description != str(node.get("description", "")):
            privilege.description = str(node.get("description", ""))
            privilege.save(update_fields=["description"])
            changed = True
        self.report.add(f"privilege {privilege.name}", changed, created=created)

    def _privilege(self, node: _Map, key: str = "required_privilege") -> Any:

        name = node.get(key)
        if name is None:
            return None
        privilege = Privilege.objects.filter(name=str(name)).first()
        if privilege is None:
            raise self.error(f"unknown privilege {name!r} (declare it under privileges)", node, key)
        return privilege

    def machine_type(self, node: _Map) -> None:

        required = {"name", "provider_account", *MachineType.REQUIRED_FIELDS}
        optional = set(MachineType.SETTABLE_FIELDS) - required
        self.fields(node, "machine type", required, optional)
        account = ProviderAccount.objects.filter(name=str(node["provider_account"]), org__isnull=True).first()
        if account is None:
            raise self.error(
                f"unknown provider account {node['provider_account']!r}", node, "provider_account"
            )
        privilege = self._privilege(node)
        values = {
            k: v for k, v in node.items() if k not in {"name", "provider_account", "required_privilege"}
        }
        existed = MachineType.objects.filter(name=str(node["name"]), org__isnull=True).exists()
        _, changed = self.guard(
            node,
            lambda: machine_type_upsert(
                name=str(node["name"]), provider_account=account, required_privilege=privilege, **values
            ),
        )
        self.report.add(f"machine type {node['name']}", changed, created=not existed)
        if checks_offerings(account.kind):
            asked = self.offerings.setdefault(
                account.name, AccountOfferings(account.kind, dict(account.config), dict(account.credentials))
            )
            offering = Offering(
                str(node["server_type"]),
                str(node.get("image") or ""),
                str(node.get("location") or ""),
                str(node.get("arch") or ""),  # checked when the catalog states it
            )
            asked.wanted.append((offering, str(node["name"]), node.line))

    def resource_type(self, node: _Map) -> None:

        self.fields(
            node,
            "resource type",
            {"id", "well"},
            {"description", "config", "max_instances", "required_privilege"},
        )
        if node["well"] not in WellKind.values:
            raise self.error(
                f"unknown well {node['well']!r}; known: {', '.join(WellKind.values)}", node, "well"
            )
        max_instances = node.get("max_instances", 10)
        if not isinstance(max_instances, int) or max_instances < 0:
            raise self.error("max_instances must be a whole number of at least 0", node, "max_instances")
        wanted = {
            "well": node["well"],
            "description": str(node.get("description", "")),
            "config": dict(node.get("config") or {}),
            "max_instances": max_instances,
            "required_privilege": self._privilege(node),
        }
        rt = ResourceType.objects.filter(id=str(node["id"])).first()
        if rt is None:
            ResourceType.objects.create(id=str(node["id"]), **wanted)
            self.report.add(f"resource type {node['id']}", True, created=True)
            return
        changed = {k: v for k, v in wanted.items() if getattr(rt, k) != v}
        for k, v in changed.items():
            setattr(rt, k, v)
        if changed:
            rt.save()
        self.report.add(f"resource type {node['id']}", bool(changed))

    def organization(self, node: _Map) -> None:

        self.fields(
            node,
            "organization",
            {"slug"},
            {"name", "privileges", "members", "grants", "budgets", "github", "gitlab"},
        )
        slug = str(node["slug"])
        org, created = Organization.objects.get_or_create(
            slug=slug, defaults={"name": str(node.get("name", slug))}
        )
        changed = created
        if not created and "name" in node and org.name != str(node["name"]):
            org.name = str(node["name"])
            org.save(update_fields=["name"])
            changed = True
        privileges = node.get("privileges") or []
        if not isinstance(privileges, list):
            raise self.error("privileges must be a list of names", node, "privileges")
        for name in privileges:
            if not Privilege.objects.filter(name=str(name)).exists():
                raise self.error(
                    f"unknown privilege {name!r} (declare it under privileges)", node, "privileges"
                )
            if not org.privileges.filter(name=str(name)).exists():
                privilege_grant(org=org, name=str(name), actor=Actor.CATALOG)
                changed = True
        for member in self.items(node, "members"):
            self.fields(member, "member", {"username", "role"}, set())
            user = user_get_or_create(username=str(member["username"]))
            before = org.memberships.filter(user=user).values_list("role", flat=True).first()
            self.guard(
                member,
                functools.partial(
                    membership_set, org=org, user=user, role=str(member["role"]), actor=Actor.CATALOG
                ),
            )
            changed = changed or before != member["role"]
        for grant in self.items(node, "grants"):
            self.fields(
                grant,
                "grant",
                {"machine_type"},
                set(OrgMachineType.QUOTA_FIELDS),
            )
            mt = self.named_machine_type(grant)
            quota = {k: v for k, v in grant.items() if k != "machine_type"}
            _, grant_changed = self.guard(
                grant, functools.partial(grant_upsert, org=org, machine_type=mt, **quota)
            )
            changed = changed or grant_changed
        for entry in self.items(node, "budgets"):
            changed = self.budget(org, entry) or changed
        self.report.add(f"organization {slug}", changed, created=created)
        if node.get("github") is not None:
            self.github(org, self.mapping(node["github"], "github", node, "github"))
        if node.get("gitlab") is not None:
            self.gitlab(org, self.mapping(node["gitlab"], "gitlab", node, "gitlab"))

    def github(self, org: Any, node: _Map) -> None:
        """``github: {app_id, private_key: {file|env}, webhook_secret: {file|env}, api_url?,
        installations: [id | {id, account}], runner_classes: [...]}`` (GitHub Actions)."""
        self.fields(
            node,
            "github",
            {"app_id", "private_key", "webhook_secret"},
            {"api_url", "installations", "runner_classes"},
        )
        existed = GitHubConnection.objects.filter(org=org).exists()
        _, changed = self.guard(
            node,
            functools.partial(
                connection_set,
                org=org,
                app_id=node["app_id"],
                api_url=node.get("api_url"),
                private_key=self.secret_ref(node["private_key"], node, "private_key"),
                webhook_secret=self.secret_ref(node["webhook_secret"], node, "webhook_secret"),
                installations=node.get("installations") or [],
                actor=Actor.CATALOG,
            ),
        )
        self.report.add(f"github connection of {org.slug}", changed, created=not existed)
        for entry in self.items(node, "runner_classes"):
            self.fields(entry, "runner class", {"name", "labels", "machine_type"}, set(CLASS_FIELDS))
            self.runner_class(org, entry, model=RunnerClass, save=runner_class_save, what="runner class")

    def gitlab(self, org: Any, node: _Map) -> None:
        """``gitlab: {url?, token: {file|env}, webhook_token: {file|env}, projects: [{id, path}],
        runner_classes: [...]}`` (GitLab CI)."""
        self.fields(node, "gitlab", {"token", "webhook_token"}, {"url", "projects", "runner_classes"})
        existed = GitLabConnection.objects.filter(org=org).exists()
        _, changed = self.guard(
            node,
            functools.partial(
                gitlab_services.connection_set,
                org=org,
                url=node.get("url"),
                token=self.secret_ref(node["token"], node, "token"),
                webhook_token=self.secret_ref(node["webhook_token"], node, "webhook_token"),
                projects=[dict(p) if isinstance(p, dict) else p for p in node.get("projects") or []],
                actor=Actor.CATALOG,
            ),
        )
        self.report.add(f"gitlab connection of {org.slug}", changed, created=not existed)
        for entry in self.items(node, "runner_classes"):
            self.fields(
                entry, "runner class", {"name", "tags", "machine_type"}, set(gitlab_services.CLASS_FIELDS)
            )
            self.runner_class(
                org,
                entry,
                model=GitLabRunnerClass,
                save=gitlab_services.runner_class_save,
                what="gitlab runner class",
            )

    def budget(self, org: Any, node: _Map) -> bool:
        """``{amount: 100, period: month | day, machine_type: NAME?}``; unchanged amounts are
        left alone (no event, thresholds not announced again)."""

        self.fields(node, "budget", {"amount"}, {"period", "machine_type"})
        mt = None
        if node.get("machine_type") is not None:
            mt = self.named_machine_type(node)
        period = str(node.get("period", "month"))
        try:
            amount = Decimal(str(node["amount"])).quantize(Decimal("0.01"))
        except (InvalidOperation, ValueError):
            amount = None
        existing = Budget.objects.filter(org=org, machine_type=mt, period=period).first()
        if existing is not None and amount is not None and existing.amount == amount:
            return False
        self.guard(
            node,
            lambda: budget_set(
                org=org, amount=node["amount"], period=period, machine_type=mt, actor=Actor.CATALOG
            ),
        )
        return True


def load(text: str, source: str = "<catalog>") -> _Map:
    try:
        doc = yaml.load(text, Loader=_LineLoader)
    except CatalogError as exc:
        raise CatalogError(str(exc).split(": ", 1)[-1], exc.line, source) from None
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else None
        context = ""
        if exc.context and exc.context_mark is not None:
            context = f" ({exc.context} started at line {exc.context_mark.line + 1})"
        raise CatalogError(f"not valid YAML: {exc.problem}{context}", line, source) from None
    if doc is None:
        return _Map()
    if not isinstance(doc, _Map):
        raise CatalogError("the catalog must be a mapping of sections", 1, source)
    return doc


def apply_catalog(
    text: str, source: str = "<catalog>", *, dry_run: bool = False, check: bool = True
) -> Report:
    """Apply a catalog document atomically. Raises :class:`CatalogError` and changes nothing.

    With ``check``, the machine types of Hetzner and AWS accounts are checked against what each
    account can buy first: the document is applied and rolled back (validating it and gathering
    what to ask), the providers are asked with no transaction open, then it is applied for real.
    """
    doc = load(text, source)
    with transaction.atomic():
        applier = _Applier(source)
        report = applier.apply(doc)
        ask = applier.offerings if check else {}
        if dry_run or ask:
            transaction.set_rollback(True)
    warnings = _offerings_checked(ask, source) if ask else []
    if ask and not dry_run:
        with transaction.atomic():
            report = _Applier(source).apply(doc)
    report.warnings = warnings
    if applier.offerings and agent_wheel() is None:
        report.warnings.append(
            "the control plane serves no agent wheel (CATACLOUD_AGENT_WHEEL): machines of the cloud "
            "accounts' types fail until it does (the Docker image sets it)"
        )
    return report


def _offerings_checked(accounts: dict[str, AccountOfferings], source: str) -> list[str]:
    """The warnings of the providers' answers; :class:`CatalogError` if any refuses a type."""
    try:
        findings = offerings_check(accounts)
    except OfferingsUnchecked as exc:
        raise CatalogError(
            f"could not check the machine types against their provider ({exc}); nothing applied "
            "(`apply --no-check` applies without asking)",
            None,
            source,
        ) from None
    refused = [f for f in findings if f.problem.refused]
    if refused:
        raise CatalogError(
            "the provider does not sell what these machine types name; nothing applied:\n  "
            + "\n  ".join(str(f) for f in refused),
            refused[0].line,
            source,
        )
    return [str(f) for f in findings]


def apply_file(path: str | Path, *, dry_run: bool = False, check: bool = True) -> Report:
    path = Path(path)
    return apply_catalog(path.read_text(), str(path), dry_run=dry_run, check=check)
