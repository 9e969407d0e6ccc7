"""Shared fixtures. Every test that needs data gets a world with an org and an outsider.

The run leaves nothing behind: the hooks of ``testkit.leftovers`` fail it when a process it
started still runs at its end, naming it."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from testkit.leftovers import (  # noqa: F401
    pytest_configure,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_testnodedown,
)

# Django-free test folders (tests/agent, tests/providers) can run with `-p no:django`:
# nothing Django is imported until a fixture needs it.
if TYPE_CHECKING:
    from rest_framework.test import APIClient

    from tests.fakes.hetzner_api import FakeHetzner


@dataclass
class World:
    """Org ``acme`` with an admin, a member and a viewer; org ``rival`` with its own admin,
    the outsider every isolation check uses; one local provider account and machine type."""

    org: Any
    other_org: Any
    account: Any
    machine_type: Any
    grant: Any
    users: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)

    def client(self, who: str) -> APIClient:
        from rest_framework.test import APIClient

        client = APIClient()
        if who != "anonymous":
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {self.tokens[who]}")
        return client


def make_world(tmp_path_factory: pytest.TempPathFactory | None = None) -> World:
    from django.contrib.auth import get_user_model

    from apps.machines.models import OrgMachineType
    from apps.orgs.models import Organization
    from apps.orgs.services import api_token_create, membership_set
    from testkit.builders import granted_type, provider_account

    users = {
        name: get_user_model().objects.create_user(name) for name in ("admin", "member", "viewer", "outsider")
    }
    org = Organization.objects.create(slug="acme", name="Acme")
    other = Organization.objects.create(slug="rival", name="Rival")
    for name in ("admin", "member", "viewer"):
        membership_set(org=org, user=users[name], role=name)
    membership_set(org=other, user=users["outsider"], role="admin")
    state_dir = (
        str(tmp_path_factory.mktemp("machines")) if tmp_path_factory else "/tmp/catacloud-test-machines"
    )
    account = provider_account("local", "local", {"state_dir": state_dir})
    mt, grant = granted_type(
        org,
        account,
        "small",
        cpus=2,
        memory_mb=4096,
        price_per_hour=Decimal("0.01"),
        billing_increment_seconds=3600,
        grant={"max_pool_size": 10, "max_instances": 20},
    )
    OrgMachineType.objects.create(org=other, machine_type=mt, max_pool_size=10, max_instances=20)
    world = World(org=org, other_org=other, account=account, machine_type=mt, grant=grant, users=users)
    for name in ("admin", "member", "viewer"):
        world.tokens[name] = api_token_create(org=org, user=users[name])[1]
    world.tokens["outsider"] = api_token_create(org=other, user=users["outsider"])[1]
    return world


@pytest.fixture
def world(db: None, tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory)


@pytest.fixture
def tworld(transactional_db: None, tmp_path_factory: pytest.TempPathFactory) -> World:
    """The same world for tests that commit (threads, workers)."""
    return make_world(tmp_path_factory)


HETZNER_TOKEN = "hetzner-test-token"


@pytest.fixture(scope="module")
def fake_hetzner() -> Iterator[FakeHetzner]:
    """The fake Hetzner Cloud API (tests/fakes/hetzner_api.py) that the real ``hcloud`` client
    talks to, one a module; its actions finish at the first poll. Tests ``reset()`` it."""
    from tests.fakes.hetzner_api import FakeHetzner

    with FakeHetzner(token=HETZNER_TOKEN, action_polls=1) as fake:
        yield fake


@pytest.fixture
def local_storage(tmp_path: Path) -> Iterator[None]:
    """Outputs and checkpoints stored under ``tmp_path`` (the local store)."""
    from django.test import override_settings

    from apps.jobs.artifacts import get_store

    get_store.cache_clear()
    with override_settings(CATACLOUD_STORAGE="local", CATACLOUD_STORAGE_DIR=str(tmp_path / "artifacts")):
        yield
    get_store.cache_clear()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Schemathesis names each API operation's test (``test_x[GET /api/v1/budgets/]``) but gives
    every one of them its function's node id; pytest-xdist schedules tests by node id, so all but
    one of them were never run (1 test instead of 81). Each gets the node id of its name, and
    two tests still sharing one stop the run."""
    for item in items:
        parent, _, last = item.nodeid.rpartition("::")
        if last != item.name and item.name.startswith(f"{last}["):
            if hasattr(item.parent, "id"):  # pytest 9: a NodeId, the parent's plus the name
                item._id = item.parent.id.child(item.name)  # type: ignore[attr-defined]
            else:
                item._nodeid = f"{parent}::{item.name}"
    shared = [nodeid for nodeid, n in collections.Counter(item.nodeid for item in items).items() if n > 1]
    if shared:  # pytest-xdist would run one of each, silently
        raise pytest.UsageError(f"tests sharing a node id: {shared[:5]}")


@pytest.fixture(autouse=True)
def _fresh_throttle_counts() -> None:
    """The API throttles count in process memory: each test starts with fresh counts."""
    from django.conf import settings

    if not settings.configured:  # a Django-free run (-p no:django)
        return
    from django.core.cache import caches

    caches["local"].clear()


@pytest.fixture(autouse=True)
def _no_scheduling_pass_pending() -> None:
    """A scheduling pass a test sent with no worker to run it leaves its mark in Redis for seconds
    (apps.jobs.dispatch.SCHEDULE_PENDING_KEY), which would hold back the next test's pass: each
    test starts with none pending."""
    from django.conf import settings

    if not settings.configured:
        return
    import redis

    from apps.core.broker import redis_client
    from apps.jobs.dispatch import SCHEDULE_PENDING_KEY

    with contextlib.suppress(redis.RedisError):
        redis_client().delete(SCHEDULE_PENDING_KEY)
