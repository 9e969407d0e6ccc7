"""Typed domain errors. Services raise them; the API maps each to its status and ``code``."""

from __future__ import annotations

from typing import Any, ClassVar


class DomainError(Exception):
    """A rule of the domain said no. ``code`` is machine-readable, ``detail`` a sentence."""

    status: ClassVar[int] = 400
    code: ClassVar[str] = "invalid"

    def __init__(self, detail: str, *, code: str | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        if code:
            self.code = code  # type: ignore[misc]
        self.extra = extra


class ValidationFailed(DomainError):
    """Input that breaks a rule. ``fields`` maps field names to messages."""

    status = 400
    code = "invalid"

    def __init__(self, detail: str, *, fields: dict[str, list[str]] | None = None, code: str | None = None):
        super().__init__(detail, code=code)
        self.fields = fields or {}


class NotFound(DomainError):
    status = 404
    code = "not_found"


class PermissionDenied(DomainError):
    status = 403
    code = "permission_denied"


class MissingPrivilege(PermissionDenied):
    code = "missing_privilege"


class Conflict(DomainError):
    status = 409
    code = "conflict"


class InvalidTransition(Conflict):
    """A compare-and-set state change lost: the row is not in a state that allows it."""

    code = "invalid_state"

    def __init__(self, entity: str, pk: Any, current: str | None, target: str) -> None:
        where = f"is {current}" if current is not None else "does not exist"
        super().__init__(f"{entity} {pk} {where}; cannot move it to {target}")
        self.entity, self.pk, self.current, self.target = entity, pk, current, target


class QuotaExceeded(Conflict):
    code = "quota_exceeded"


class PoolEmpty(Conflict):
    code = "pool_empty"


class PoolAtMaxSize(Conflict):
    code = "pool_at_max_size"
