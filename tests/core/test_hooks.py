"""The upward calls of apps/core/hooks.py: every hook has a caller below and a handler above,
wired once (apps/control/wiring.py), and a hook without a handler refuses to be called."""

from __future__ import annotations

import ast

import pytest

from apps.core import hooks
from tests.core.sources import ROOT, product_sources


def _called_hooks() -> dict[str, list[str]]:
    """``hooks.<name>(...)`` calls in the apps: {hook name: [file, ...]}."""
    calls: dict[str, list[str]] = {}
    for path, tree in product_sources("apps"):
        if path.name == "hooks.py":
            continue
        for node in ast.walk(tree):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "hooks":
                calls.setdefault(func.attr, []).append(str(path.relative_to(ROOT)))
    return calls


def test_the_list_holds_every_hook_of_the_module() -> None:
    declared = {name for name, value in vars(hooks).items() if isinstance(value, hooks.Hook)}
    assert {hook.name for hook in hooks.ALL} == declared
    assert len(declared) >= 5


@pytest.mark.parametrize("hook", hooks.ALL, ids=lambda hook: hook.name)
def test_every_hook_has_a_caller_and_a_public_handler(hook: hooks.Hook) -> None:
    callers = _called_hooks().get(hook.name, [])
    assert callers, f"nothing calls hooks.{hook.name}: remove it"
    assert all(not path.startswith("apps/control/wiring.py") for path in callers)
    assert hook.handler is not None, f"hooks.{hook.name} has no handler (apps/control/wiring.py)"
    # the handler is the service itself, not a private wrapper a reader must go through
    assert not hook.handler.__name__.startswith("_"), hook.handler


def test_every_call_names_a_declared_hook() -> None:
    declared = {hook.name for hook in hooks.ALL}
    wiring_only = {"ALL", "Hook", "HookNotConnected"}
    assert set(_called_hooks()) - declared - wiring_only == set()


def test_a_hook_without_a_handler_raises() -> None:
    @hooks.Hook
    def unwired(*, value: int) -> None:
        """A hook nobody connected."""

    with pytest.raises(hooks.HookNotConnected, match="unwired"):
        unwired(value=1)
    unwired.connect(lambda *, value: None)
    assert unwired(value=1) is None
