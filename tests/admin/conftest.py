"""The console's tests log in as an operator (a superuser)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.conftest import World


@pytest.fixture
def ops(world: World) -> Client:
    get_user_model().objects.create_superuser("ops", password="a-long-ops-password")
    client = Client()
    client.login(username="ops", password="a-long-ops-password")
    return client
