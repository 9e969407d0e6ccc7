"""Organizations bring their own cloud: provider accounts an organization admin adds (its own
credentials, its own bill) and the machine types on them, which only that organization sees and
uses. Everything else treats them as the operator's: placement, pools, reuse, quotas, budgets,
runner classes, the reconciler (apps/machines/reconcile.py lists every account's machines).

What stays the operator's: which provider kinds organizations may bring
(``CATACLOUD_ORG_PROVIDER_KINDS``), and where their accounts' calls go
(``CATACLOUD_ORG_PROVIDER_SETTINGS``: endpoints, retries, timeouts). An organization sets only
the keys of :data:`ORG_CONFIG_KEYS`: never an endpoint, so it cannot point the control plane's
workers at an address of its choosing.

The credentials are checked by one cheap read call to the provider before anything is stored
(:meth:`catacloud.providers.Provider.check_credentials`), outside any transaction.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.db.models.deletion import ProtectedError

from apps.core.actors import Actor
from apps.core.errors import Conflict, ErrorCode, PermissionDenied, ValidationFailed
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.choices import ProviderKind
from apps.machines.models import MachineType, OrgMachineType, ProviderAccount
from apps.machines.services import (
    SLUG,
    grant_clean_quota,
    machine_type_clean,
    machine_type_update,
    provider_account_update,
)
from apps.orgs.models import Organization
from catacloud.providers import ProviderError, build_provider

# The kinds an organization may ever bring (the operator's setting narrows them): clouds that
# bill the organization. Never local (agents on the control plane's own host), fake or hosts
# (an organization's own hosts enroll with its enrolment tokens).
ORG_KINDS = (ProviderKind.HETZNER, ProviderKind.AWS, ProviderKind.AZURE)

# What an organization sets in its account's config, per kind (each driver's module docstring
# says what they mean). The rest (endpoints, retries, timeouts, page sizes) is the operator's.
ORG_CONFIG_KEYS: dict[str, frozenset[str]] = {
    ProviderKind.HETZNER: frozenset({"location", "ssh_keys", "network"}),
    ProviderKind.AWS: frozenset({"region", "subnet_id", "security_group_ids", "key_name"}),
    ProviderKind.AZURE: frozenset(
        {
            "subscription_id",
            "resource_group",
            "location",
            "subnet_id",
            "public_ip",
            "admin_username",
            "ssh_public_key",
        }
    ),
}

# What an organization sets on its own machine types: the operator's fields but the privilege
# (the operator's gate to the operator's types) and host labels (enrolled hosts only).
ORG_TYPE_FIELDS = tuple(
    f for f in MachineType.SETTABLE_FIELDS if f not in ("required_privilege", "host_labels")
)

OPERATORS_OWN = "{what} {name} is the operator's: only the operator changes it"


def allowed_kinds() -> list[str]:
    """The provider kinds organizations may bring here, by the operator's setting."""
    return [k for k in settings.CATACLOUD_ORG_PROVIDER_KINDS if k in ORG_KINDS]


def own_accounts(*, org: Organization) -> QuerySet[ProviderAccount]:
    return ProviderAccount.objects.filter(org=org)


def operator_settings(kind: str) -> dict[str, Any]:
    """What the operator sets for every organization's account of ``kind`` (endpoints, ...)."""
    return dict(settings.CATACLOUD_ORG_PROVIDER_SETTINGS.get(kind) or {})


# ---- accounts -----------------------------------------------------------------------------------


def _clean_account(kind: str, config: Any, credentials: Any) -> tuple[dict[str, Any], dict[str, str] | None]:
    if kind not in ORG_KINDS:
        known = ", ".join(ORG_KINDS)
        raise ValidationFailed.field("kind", f"an organization's own account is one of: {known}")
    if kind not in allowed_kinds():
        allowed = ", ".join(allowed_kinds()) or "none"
        raise PermissionDenied(
            f"this installation does not allow organizations' own {kind} accounts (allowed: {allowed})",
            code=ErrorCode.PROVIDER_KIND_NOT_ALLOWED,
        )
    if not isinstance(config, dict):
        raise ValidationFailed.field("config", "must be an object")
    extra = sorted(set(config) - ORG_CONFIG_KEYS[kind])
    if extra:
        keys = ", ".join(sorted(ORG_CONFIG_KEYS[kind]))
        raise ValidationFailed.field(
            "config", f"{extra[0]} is set by the operator only; an account may set: {keys}"
        )
    if credentials is not None and (
        not isinstance(credentials, dict)
        or not credentials
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in credentials.items())
    ):
        raise ValidationFailed.field("credentials", "must be an object of strings")
    return dict(config), credentials


def account_check(*, kind: str, config: dict[str, Any], credentials: dict[str, str]) -> None:
    """One cheap read call with these credentials (never inside a transaction); the provider's
    refusal is a 400 ``provider_check_failed`` with the provider's own message."""
    try:
        provider = build_provider(kind, config={**config, **operator_settings(kind)}, credentials=credentials)
        provider.check_credentials()
    except (ProviderError, ValueError, TypeError) as exc:  # a driver refusing a setting's value too
        raise ValidationFailed(
            f"the provider refused these credentials or settings: {exc}",
            fields={"credentials": [str(exc)]},
            code=ErrorCode.PROVIDER_CHECK_FAILED,
        ) from None


def org_account_create(
    *, org: Organization, actor: Actor, name: str, kind: str, config: Any, credentials: Any
) -> ProviderAccount:
    """Add an organization's own provider account once the provider accepted its credentials."""
    _clean_name(name)
    if not credentials:
        raise ValidationFailed.field("credentials", "this field is required")
    config, credentials = _clean_account(kind, config, credentials)
    if own_accounts(org=org).filter(name=name).exists():
        raise _duplicate("name", f"your organization has a provider account named {name}")
    assert credentials is not None
    account_check(kind=kind, config=config, credentials=credentials)
    try:
        with transaction.atomic():
            account = ProviderAccount(name=name, kind=kind, config=config, org=org)
            account.credentials = credentials
            account.save()
            event_record(
                kind=EventKind.PROVIDER_ACCOUNT_CREATED, org=org, actor=actor, account=name, provider=kind
            )
    except IntegrityError:  # the same name, added at the same moment
        raise _duplicate("name", f"your organization has a provider account named {name}") from None
    return account


def org_account_update(
    *,
    org: Organization,
    account: ProviderAccount,
    actor: Actor,
    name: str | None = None,
    config: Any = None,
    credentials: Any = None,
) -> ProviderAccount:
    """Rename an own account or change its config or credentials (checked again first)."""
    account = own_account(org=org, account=account)
    if name is not None:
        _clean_name(name)
    new_config, new_credentials = _clean_account(
        account.kind, account.config if config is None else config, credentials
    )
    if config is not None or credentials is not None:
        account_check(
            kind=account.kind, config=new_config, credentials=new_credentials or account.credentials
        )
    changed, _ = provider_account_update(
        account=account,
        name=name or account.name,
        config=new_config,
        credentials=new_credentials,
        actor=actor,
    )
    return changed


def org_account_delete(*, org: Organization, account: ProviderAccount, actor: Actor) -> None:
    """Remove an own account that no machine type uses any more."""
    account = own_account(org=org, account=account)
    with transaction.atomic():
        if account.machine_types.exists():
            names = ", ".join(account.machine_types.values_list("name", flat=True)[:5])
            raise Conflict(
                f"machine types still use provider account {account.name}: {names}", code=ErrorCode.IN_USE
            )
        try:
            account.delete()
        except ProtectedError:
            raise Conflict(
                f"provider account {account.name} still has machines", code=ErrorCode.IN_USE
            ) from None
        event_record(kind=EventKind.PROVIDER_ACCOUNT_DELETED, org=org, actor=actor, account=account.name)


def own_account(*, org: Organization, account: ProviderAccount) -> ProviderAccount:
    if account.org_id != org.pk:
        raise PermissionDenied(
            OPERATORS_OWN.format(what="provider account", name=account.name), code=ErrorCode.OPERATORS_OWN
        )
    return account


def _clean_name(name: Any) -> None:
    """An account's or a type's name: a slug, as the operator's are."""
    if not isinstance(name, str) or not SLUG.fullmatch(name):
        raise ValidationFailed.field("name", "letters, digits, - and _ (at most 64)")


def _duplicate(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]}, code=ErrorCode.DUPLICATE_NAME)


# ---- machine types --------------------------------------------------------------------------------


def _clean_type_fields(org: Organization, fields: dict[str, Any]) -> dict[str, Any]:
    extra = sorted(set(fields) - set(ORG_TYPE_FIELDS))
    if extra:
        raise ValidationFailed.field(extra[0], "not a field of an organization's own machine type")
    fields = machine_type_clean(fields)
    unknown = [n for n in fields.get("alternatives", []) if not _usable(org).filter(name=n).exists()]
    if unknown:
        raise ValidationFailed.field(
            "alternatives", f"{unknown[0]} is no machine type your organization may use"
        )
    return fields


def _usable(org: Organization) -> QuerySet[MachineType]:
    """Every machine type ``org`` may use: granted by the operator, or its own (granted too)."""
    return MachineType.objects.filter(Q(grants__org=org) | Q(org=org)).distinct()


def org_machine_type_create(
    *,
    org: Organization,
    actor: Actor,
    name: str,
    account: ProviderAccount,
    limits: dict[str, Any] | None = None,
    **fields: Any,
) -> MachineType:
    """A machine type on the organization's own account, granted to it alone with ``limits``
    (the grant's quota fields: its own guard rails on its own bill)."""
    own_account(org=org, account=account)
    _clean_name(name)
    missing = [f for f in MachineType.REQUIRED_FIELDS if f not in fields]
    if missing:
        raise ValidationFailed.field(missing[0], "this field is required")
    fields = _clean_type_fields(org, fields)
    limits = dict(limits or {})
    grant_clean_quota(limits)
    with transaction.atomic():
        if _usable(org).filter(name=name).exists():
            raise _duplicate("name", f"your organization already uses a machine type named {name}")
        try:
            with transaction.atomic():
                mt = MachineType.objects.create(name=name, provider_account=account, org=org, **fields)
        except IntegrityError:
            raise _duplicate("name", f"your organization already uses a machine type named {name}") from None
        OrgMachineType.objects.create(org=org, machine_type=mt, **limits)
        event_record(kind=EventKind.MACHINE_TYPE_CREATED, org=org, actor=actor, machine_type=name, own=True)
    return mt


def own_machine_type(*, org: Organization, machine_type: MachineType) -> MachineType:
    if machine_type.org_id != org.pk:
        raise PermissionDenied(
            OPERATORS_OWN.format(what="machine type", name=machine_type.name), code=ErrorCode.OPERATORS_OWN
        )
    return machine_type


def org_machine_type_update(
    *,
    org: Organization,
    machine_type: MachineType,
    actor: Actor,
    limits: dict[str, Any] | None = None,
    **fields: Any,
) -> MachineType:
    """Change an own machine type (a change to how machines are built makes existing ones
    outdated, as for the operator's) and its limits."""
    mt = own_machine_type(org=org, machine_type=machine_type)
    if "provider_account" in fields:
        own_account(org=org, account=fields["provider_account"])
    name = fields.pop("name", None)
    fields = _clean_type_fields(org, fields)
    with transaction.atomic():
        if name is not None and name != mt.name:
            _clean_name(name)
            if _usable(org).filter(name=name).exclude(pk=mt.pk).exists():
                raise _duplicate("name", f"your organization already uses a machine type named {name}")
            fields["name"] = name
        mt, _ = machine_type_update(machine_type=mt, actor=actor, **fields)
        if limits:
            grant_clean_quota(limits)
            OrgMachineType.objects.filter(org=org, machine_type=mt).update(**limits)
    return mt


def org_machine_type_delete(*, org: Organization, machine_type: MachineType, actor: Actor) -> None:
    """Remove an own machine type nothing uses any more (no machine, pool or configuration)."""
    mt = own_machine_type(org=org, machine_type=machine_type)
    try:
        with transaction.atomic():
            OrgMachineType.objects.filter(machine_type=mt).delete()
            mt.delete()
            event_record(kind=EventKind.MACHINE_TYPE_DELETED, org=org, actor=actor, machine_type=mt.name)
    except ProtectedError as exc:
        used = sorted({str(type(o)._meta.verbose_name_plural) for o in exc.protected_objects})
        raise Conflict(
            f"machine type {mt.name} is still used by {', '.join(used)}", code=ErrorCode.IN_USE
        ) from None
