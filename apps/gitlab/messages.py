"""The gitlab app's Celery tasks (apps/gitlab/tasks.py), by their registered names: the services
send them by name, so no service imports the tasks module, which imports the services. Messages
only make things sooner: the reaper's convergence finds the same work without them."""

from __future__ import annotations

HANDOFF_TASK = "apps.gitlab.tasks.handoff_task"
RETIRE_TASK = "apps.gitlab.tasks.retire_task"
CONVERGE_TASK = "apps.gitlab.tasks.converge_task"
RECONCILE_TASK = "apps.gitlab.tasks.reconcile_task"
FINISHED_TASK = "apps.gitlab.tasks.finished_task"
RESOLVE_TASK = "apps.gitlab.tasks.resolve_task"
