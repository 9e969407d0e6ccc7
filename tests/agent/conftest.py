"""Fixtures of the agent tests: a fake Agent API and the agent as a real process."""

from __future__ import annotations

from tests.agent.harness import api, imds, start_agent, work_dir

__all__ = ["api", "imds", "start_agent", "work_dir"]
