"""The public contracts kept in registries: event kinds (apps.events.kinds.EventKind) and error
codes (apps.core.errors.ErrorCode). What the code emits, what the registries list and what
the documentation tells users (docs/architecture/events-and-errors.md) must be the same sets."""

from __future__ import annotations

import ast
import re

import pytest
from django.test import override_settings

from apps.core.errors import DomainError, ErrorCode, error_payload
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.events.services import event_record
from apps.jobs.services import JOB_STATES
from apps.machines.services import INSTANCE_STATES
from apps.pools.services import POOL_STATES
from apps.resources.services import RESOURCE_STATES
from tests.core.sources import ROOT, product_sources

KINDS = set(EventKind._value2member_map_)
CODES = set(ErrorCode._value2member_map_)


def _constants(node: ast.AST) -> list[str]:
    """String constants an expression may evaluate to (plain, or either side of an ``x if c else y``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _constants(node.body) + _constants(node.orelse)
    return []


def _events_page() -> str:
    """The documentation's page of event kinds and error codes."""
    return (ROOT / "docs" / "architecture" / "events-and-errors.md").read_text()


def _members_used(registry: str) -> dict[str, str]:
    """``Registry.NAME`` attributes the code reads: {name: file}."""
    used: dict[str, str] = {}
    for path, tree in product_sources("apps"):
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and getattr(node.value, "id", "") == registry
                and not node.attr.startswith("_")
            ):
                used[node.attr] = str(path.relative_to(ROOT))
    return used


def test_every_event_kind_the_code_records_is_a_registered_member() -> None:
    used = _members_used("EventKind")
    assert len(used) > 40  # the scan sees the code
    assert {name: f for name, f in used.items() if name not in EventKind.__members__} == {}


def test_no_event_kind_is_passed_as_a_string() -> None:
    """Kinds are ``EventKind`` members at every call (mypy then refuses a wrong name): no
    ``kind=``/``event=`` string, and no string kind handed to the claim statements."""
    literals: dict[str, str] = {}
    for path, tree in product_sources("apps"):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            values = [kw.value for kw in node.keywords if kw.arg in ("kind", "event")]
            if getattr(node.func, "id", "") == "_sql" and len(node.args) >= 2:
                values.append(node.args[1])  # the claim statements write their event in SQL
            for value in values:
                for kind in _constants(value):
                    if re.fullmatch(r"[a-z_]+\.[a-z_]+", kind):
                        literals[kind] = str(path.relative_to(ROOT))
    assert literals == {}


@pytest.mark.parametrize("machine", [JOB_STATES, INSTANCE_STATES, POOL_STATES, RESOURCE_STATES])
def test_every_state_change_records_a_registered_kind(machine) -> None:
    states = set(machine.graph) | {t for targets in machine.graph.values() for t in targets}
    kinds = {machine.events.get(state, f"{machine.event_prefix}.{state}") for state in states}
    assert kinds - KINDS == set()


def test_the_docs_list_every_event_kind_and_only_those() -> None:
    listed = set(re.findall(r"`([a-z_]+\.[a-z_]+)`", _events_page()))
    assert listed == KINDS


def test_the_docs_list_every_error_code_and_only_those() -> None:
    section = _events_page()
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M))
    assert listed == CODES


def test_every_error_code_the_code_uses_is_a_registered_member() -> None:
    used = _members_used("ErrorCode")
    assert len(used) > 20  # the scan sees the code
    assert {name: f for name, f in used.items() if name not in ErrorCode.__members__} == {}

    def subclasses(cls: type) -> list[type]:
        return [cls, *(s for sub in cls.__subclasses__() for s in subclasses(sub))]

    assert {cls.__name__ for cls in subclasses(DomainError) if not isinstance(cls.code, ErrorCode)} == set()


def test_no_error_code_is_passed_as_a_string() -> None:
    """Codes are ``ErrorCode`` members: no ``code=`` string, no string handed to the error
    builders, no error class whose ``code`` is a string."""
    literals: dict[str, str] = {}
    for path, tree in product_sources("apps"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "code":
                        for code in _constants(kw.value):
                            literals[code] = str(path.relative_to(ROOT))
                name = getattr(node.func, "id", "")
                if name in ("error_response", "error_payload") and node.args:
                    arg = node.args[1] if name == "error_response" and len(node.args) > 1 else node.args[0]
                    for code in _constants(arg):
                        literals[code] = str(path.relative_to(ROOT))
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", "") == "code":
                        for code in _constants(stmt.value):
                            literals[code] = str(path.relative_to(ROOT))
    assert literals == {}


@pytest.mark.django_db
def test_an_unregistered_event_kind_is_refused_in_strict_mode_and_logged_otherwise(caplog) -> None:
    with pytest.raises(ValueError, match="not registered"):
        event_record(kind="pool.exploded")
    with override_settings(CATACLOUD_STRICT_REGISTRIES=False):
        event_record(kind="pool.exploded")
    assert Event.objects.filter(kind="pool.exploded").count() == 1  # recorded all the same
    assert "not registered" in caplog.text


def test_an_unregistered_error_code_is_refused_in_strict_mode() -> None:
    with pytest.raises(ValueError, match="not registered"):
        error_payload("oops", "something")
    with pytest.raises(ValueError):
        DomainError("no", code="oops")
    body = error_payload("pool_empty", "no ready member")
    assert body == {"code": "pool_empty", "detail": "no ready member"}


def _keyword_literals(*names: str) -> dict[str, str]:
    """String constants given as one of the keyword arguments ``names`` anywhere in apps/, and
    f-strings given there: {text: file}."""
    found: dict[str, str] = {}
    for path, tree in product_sources("apps"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg in names:
                        for text in _constants(kw.value):
                            found[text] = str(path.relative_to(ROOT))
                        if isinstance(kw.value, ast.JoinedStr):
                            found[ast.unparse(kw.value)] = str(path.relative_to(ROOT))
    return found


def test_every_cause_is_a_member_never_free_text() -> None:
    """Why a machine ended and why a job was requeued (stored, shown, compared): Cause members,
    never strings; every member fits the 32 characters the columns hold."""
    from apps.core.causes import Cause

    assert _keyword_literals("cause", "end_cause", "requeue_reason") == {}
    assert max(len(c.value) for c in Cause) <= 32


def test_every_actor_is_made_by_the_actor_type() -> None:
    """Who did something renders one way everywhere: Actor's names and constructors, never a
    string or an f-string at a call (there were about 100 such sites in some 20 spellings)."""
    assert _keyword_literals("actor") == {}
    from apps.core.actors import Actor

    assert {name: f for name, f in _members_used("Actor").items() if not hasattr(Actor, name)} == {}


def _status_values() -> set[str]:
    from apps.github.choices import WorkflowJobStatus
    from apps.gitlab.choices import GitLabJobStatus
    from apps.jobs.choices import ArtifactStatus, JobStatus
    from apps.machines.choices import InstanceStatus
    from apps.pools.choices import PoolStatus
    from apps.resources.choices import ResourceStatus

    enums = (
        JobStatus,
        InstanceStatus,
        PoolStatus,
        ResourceStatus,
        ArtifactStatus,
        WorkflowJobStatus,
        GitLabJobStatus,
    )
    return {str(member.value) for enum in enums for member in enum}


def _is_status(node: ast.AST) -> bool:
    """``x.status``, ``row["status"]``, ``x.end_state`` and the like."""
    if isinstance(node, ast.Attribute):
        return node.attr == "status" or node.attr.endswith("_status")
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.endswith("status")
    return False


def test_statuses_are_compared_and_set_through_their_enums() -> None:
    """A status is written ``JobStatus.READY``, never ``"ready"``: in a comparison with a
    status, a ``status=``/``status__in=`` filter or a state machine's ``to=``."""
    values = _status_values()
    found: dict[str, str] = {}
    for path, tree in product_sources("apps"):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(_is_status(n) for n in [node.left, *node.comparators]):
                for side in [node.left, *node.comparators]:
                    elements = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                    for element in elements:
                        for text in _constants(element):
                            if text in values:
                                found[f"{where}:{node.lineno} {text}"] = where
            elif isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg and (kw.arg == "to" or kw.arg.endswith(("status", "status__in"))):
                        value = kw.value
                        elements = (
                            value.elts if isinstance(value, ast.Tuple | ast.List | ast.Set) else [value]
                        )
                        for element in elements:
                            for text in _constants(element):
                                if text in values:
                                    found[f"{where}:{node.lineno} {text}"] = where
    assert found == {}
