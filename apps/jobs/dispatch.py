"""After-commit messages of the jobs app: a scheduling pass, an agent's wake-up. Messages only
make things faster (the reaper and the agent's long poll find the same work without them)."""

from __future__ import annotations

from apps.core.broker import enqueue_on_commit
from apps.core.ids import InstanceId


def schedule_after_commit() -> None:
    from apps.jobs.tasks import schedule_task  # tasks import the scheduler, which imports this

    enqueue_on_commit(schedule_task)


def wake_agent(instance_id: InstanceId) -> None:
    """Tell a long-polling agent to look again (a message, never state: the DB is the truth)."""
    from apps.jobs.agent import wake  # the agent views import the reports, which import this

    wake(instance_id)
