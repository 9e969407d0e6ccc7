"""The product's source files, parsed once per test run, for the tests that read the code itself
(registries, hooks, task names, the length of functions)."""

from __future__ import annotations

import ast
import functools
import gc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse(text: str) -> ast.Module:
    """``ast.parse`` with the garbage collector paused. CPython 3.11 keeps the AST conversion's
    recursion depth in one interpreter-wide field (python/cpython#106905): when a collection in the
    middle of a conversion runs a finalizer's Python code, another thread may run (the live
    server's thread formatting a traceback calls ``ast.parse`` for its ``^^^`` marks) and the
    conversion fails with "AST constructor recursion depth mismatch". Without collections the
    conversion runs no Python code, so no other thread runs before it ends. (Paused, not run:
    a full collection of a test worker's heap takes 50 ms or more, per file.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(text)
    finally:
        if was_enabled:
            gc.enable()


@functools.cache
def product_sources(*packages: str) -> tuple[tuple[Path, ast.Module], ...]:
    """Every ``.py`` file under ``packages`` (folders of the checkout: ``"apps"``, ``"catacloud"``,
    ``"config"``), migrations aside, with its syntax tree, in path order."""
    return tuple(
        (path, parse(path.read_text()))
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts
    )
