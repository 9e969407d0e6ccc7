"""Fixtures shared with the tests of the areas these boundaries cross."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.agent.harness import api, start_agent, work_dir  # noqa: F401 - fixtures
from tests.jobs.test_artifacts import moto_s3  # noqa: F401 - fixtures
from tests.security import netlab
from tests.security.test_network_isolation import service  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def lab() -> Iterator[netlab.Lab]:
    """The network lab (tests/security/netlab.py): namespaces of the test's own holding a public,
    a private and a link-local address and the side doors' ranges; one per test module."""
    why = netlab.available()
    if why is not None:
        pytest.skip(why)
    started = netlab.Lab.start()
    yield started
    started.stop()
