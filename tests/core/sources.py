"""The product's source files, parsed once per test run, for the tests that read the code itself
(registries, hooks, task names, the length of functions)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def product_sources(*packages: str) -> tuple[tuple[Path, ast.Module], ...]:
    """Every ``.py`` file under ``packages`` (folders of the checkout: ``"apps"``, ``"catacloud"``,
    ``"config"``), migrations aside, with its syntax tree, in path order."""
    return tuple(
        (path, ast.parse(path.read_text()))
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts
    )
