"""Services send Celery tasks by name (apps/jobs/dispatch.py and the other ``*_TASK`` names), so
no service imports a tasks module: every such name must be a task the workers know."""

from __future__ import annotations

import ast

from tests.core.sources import ROOT, product_sources


def _names_sent() -> dict[str, str]:
    """``*_TASK = "apps.…"`` constants of the apps: {task name: file}."""
    names: dict[str, str] = {}
    for path, tree in product_sources("apps"):
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", "").endswith("_TASK")
                and isinstance(node.value, ast.Constant)
            ):
                names[node.value.value] = str(path.relative_to(ROOT))
    return names


def test_every_task_sent_by_name_is_one_the_workers_run() -> None:
    from config.celery import app

    app.loader.import_default_modules()  # what a worker loads: every app's tasks module
    sent = _names_sent()
    assert len(sent) >= 7  # the scan sees the code
    assert {name: path for name, path in sent.items() if name not in app.tasks} == {}
