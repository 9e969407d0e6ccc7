"""Fixtures shared with the tests of the areas these boundaries cross."""

from tests.agent.harness import api, start_agent, work_dir  # noqa: F401 - fixtures
from tests.jobs.test_artifacts import moto_s3  # noqa: F401 - fixtures
