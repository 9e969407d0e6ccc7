"""The github app's Celery tasks (apps/github/tasks.py), by their registered names: the services
send them by name, so no service imports the tasks module, which imports the services. Messages
only make things sooner: the reaper's convergence finds the same work without them."""

from __future__ import annotations

HANDOFF_TASK = "apps.github.tasks.handoff_task"
RETIRE_TASK = "apps.github.tasks.retire_task"
CONVERGE_TASK = "apps.github.tasks.converge_task"
RECONCILE_TASK = "apps.github.tasks.reconcile_task"
