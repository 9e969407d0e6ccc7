"""The product's functions stay short enough to read in one screen: none in apps/, catacloud/ or
config/ (migrations aside) runs over 80 lines. A longer one is split by what changes together,
as the agent's job run was (catacloud/agent/jobrun.py)."""

from __future__ import annotations

import ast

from tests.core.sources import ROOT, product_sources

LONGEST = 80


def _functions() -> list[tuple[int, str]]:
    found = []
    for path, tree in product_sources("apps", "catacloud", "config"):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((length, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return found


def test_no_product_function_runs_over_80_lines() -> None:
    functions = _functions()
    assert len(functions) > 1000  # the walk found the product
    assert [f"{where} ({n} lines)" for n, where in functions if n > LONGEST] == []
