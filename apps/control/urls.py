"""URL assembly for the surfaces that span apps: the Agent API (machine and job endpoints)."""

from __future__ import annotations

from apps.jobs.agent import job_agent_urls
from apps.machines.agent_api import machine_agent_urls


def agent_urls() -> list:
    return machine_agent_urls() + job_agent_urls()
