"""Typed domain errors. Services raise them; the API maps each to its status and ``code``."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from apps.core.registry import registered


class ErrorCode(StrEnum):
    """Every ``code`` an API answer may carry (docs/architecture/events-and-errors.md lists them
    all, and a test keeps the two equal). Clients match on these; renaming one is a breaking change."""

    # 400
    INVALID = "invalid"  # input breaks a rule; ``fields`` says which
    PARSE_ERROR = "parse_error"  # the body is not JSON, or nested too deeply
    DUPLICATE_NAME = "duplicate_name"
    INVALID_SIZES = "invalid_sizes"  # pool min <= target <= max
    INVALID_RANGE = "invalid_range"  # a time range that ends before it starts
    CHECKSUM_MISMATCH = "checksum_mismatch"  # an uploaded artifact's sha256 differs
    UNKNOWN_CONFIG = "unknown_config"  # a job submitted with no such configuration id or name
    ENV_TOO_LARGE = "env_too_large"  # a job's env and secret_env past their limits
    INVALID_IMAGE_REFERENCE = "invalid_image_reference"  # an image reference that is not one
    PROVIDER_CHECK_FAILED = "provider_check_failed"  # an own account's credentials the cloud refused
    # 401 / 403
    NOT_AUTHENTICATED = "not_authenticated"
    AUTHENTICATION_FAILED = "authentication_failed"
    INVALID_BOOTSTRAP_TOKEN = "invalid_bootstrap_token"
    INVALID_ENROLMENT_TOKEN = "invalid_enrolment_token"  # a host's enrolment token that is not live
    INVALID_SIGNATURE = "invalid_signature"  # a webhook delivery without a valid signature
    PERMISSION_DENIED = "permission_denied"
    MISSING_PRIVILEGE = "missing_privilege"
    SHARED_HOST = "shared_host"  # an organization changing a host the operator shares
    OPERATORS_OWN = "operators_own"  # an organization changing the operator's account or type
    PROVIDER_KIND_NOT_ALLOWED = "provider_kind_not_allowed"  # own accounts of a kind the operator forbids
    METRICS_CLOSED = "metrics_closed"
    # 404 / 405 / 406 / 411 / 413 / 415
    NOT_FOUND = "not_found"
    NOT_A_MEMBER = "not_a_member"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NOT_ACCEPTABLE = "not_acceptable"
    LENGTH_REQUIRED = "length_required"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    NO_MACHINE_TYPE_FITS = "no_machine_type_fits"  # requirements no granted type meets
    # 409
    CONFLICT = "conflict"  # a concurrent change won
    INVALID_STATE = "invalid_state"  # the object's state does not allow this
    IN_USE = "in_use"
    QUOTA_EXCEEDED = "quota_exceeded"
    POOL_EMPTY = "pool_empty"
    POOL_AT_MAX_SIZE = "pool_at_max_size"
    MACHINE_TYPE_NOT_GRANTED = "machine_type_not_granted"
    HELD_BY_JOB = "held_by_job"
    CLAIM_MISMATCH = "claim_mismatch"
    JOB_NOT_RUNNING = "job_not_running"
    NOT_ASSIGNED = "not_assigned"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"  # the key named another submit
    ALREADY_ENROLLED = "already_enrolled"
    # 426
    AGENT_UPGRADE_REQUIRED = "agent_upgrade_required"  # an agent older than the protocol allows
    # 429 / 500 / any other status
    THROTTLED = "throttled"
    TOO_MANY_CONNECTIONS = "too_many_connections"  # the agent server: one machine's budget
    SERVER_ERROR = "server_error"
    DATABASE_UNAVAILABLE = "database_unavailable"  # 503: PostgreSQL did not answer; retry
    INSTALL_SCRIPT_UNAVAILABLE = "install_script_unavailable"  # 503: no agent wheel to pin in it
    ERROR = "error"  # a status with no code of its own
    # A job's failure_code (no HTTP status: the job ended failed with it), as its agent reported
    # it (catacloud.protocol.ImageFailure has the same values).
    IMAGE_NOT_FOUND = "image_not_found"
    IMAGE_AUTH_FAILED = "image_auth_failed"
    IMAGE_TOO_LARGE = "image_too_large"
    IMAGE_DIGEST_MISMATCH = "image_digest_mismatch"
    IMAGE_PULL_TIMEOUT = "image_pull_timeout"
    IMAGE_PULL_FAILED = "image_pull_failed"
    IMAGE_UNUSABLE = "image_unusable"
    # A CI runner job's failure_code, as its forge's integration names its exit: the runner's
    # version is one the forge no longer accepts (actions/runner exits 7).
    RUNNER_OUTDATED = "runner_outdated"


def error_payload(code: ErrorCode, detail: str, **extra: Any) -> dict[str, Any]:
    """The body of every API error, ``{code, detail, ...}`` (an unregistered code: see
    :func:`apps.core.registry.registered`)."""
    return {"code": str(registered(code, ErrorCode)), "detail": detail, **extra}


class DomainError(Exception):
    """A rule of the domain said no. ``code`` is machine-readable, ``detail`` a sentence."""

    status: ClassVar[int] = 400
    code: ErrorCode = ErrorCode.INVALID  # the class's; an instance may name a narrower one

    def __init__(self, detail: str, *, code: ErrorCode | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        if code:
            self.code = registered(code, ErrorCode)
        self.extra = extra


class ValidationFailed(DomainError):
    """Input that breaks a rule. ``fields`` maps field names to messages."""

    status = 400
    code = ErrorCode.INVALID

    def __init__(
        self, detail: str, *, fields: dict[str, list[str]] | None = None, code: ErrorCode | None = None
    ) -> None:
        super().__init__(detail, code=code)
        self.fields = fields or {}

    @classmethod
    def field(cls, name: str, message: str) -> ValidationFailed:
        """``name: message``, naming the one field that is wrong."""
        return cls(f"{name}: {message}", fields={name: [message]})


class Unauthenticated(DomainError):
    status = 401
    code = ErrorCode.AUTHENTICATION_FAILED


class LengthRequired(DomainError):
    status = 411
    code = ErrorCode.LENGTH_REQUIRED


class UpgradeRequired(DomainError):
    """An agent speaks a protocol older than this control plane accepts (catacloud.protocol)."""

    status = 426
    code = ErrorCode.AGENT_UPGRADE_REQUIRED


class NotFound(DomainError):
    status = 404
    code = ErrorCode.NOT_FOUND


class PermissionDenied(DomainError):
    status = 403
    code = ErrorCode.PERMISSION_DENIED


class MissingPrivilege(PermissionDenied):
    code = ErrorCode.MISSING_PRIVILEGE


class Conflict(DomainError):
    status = 409
    code = ErrorCode.CONFLICT


class InvalidTransition(Conflict):
    """A compare-and-set state change lost: the row is not in a state that allows it."""

    code = ErrorCode.INVALID_STATE

    def __init__(self, entity: str, pk: object, current: str | None, target: str) -> None:
        where = f"is {current}" if current is not None else "does not exist"
        super().__init__(f"{entity} {pk} {where}; cannot move it to {target}")
        self.entity, self.pk, self.current, self.target = entity, pk, current, target


class QuotaExceeded(Conflict):
    code = ErrorCode.QUOTA_EXCEEDED


class PoolEmpty(Conflict):
    code = ErrorCode.POOL_EMPTY


class PoolAtMaxSize(Conflict):
    code = ErrorCode.POOL_AT_MAX_SIZE
