"""The test run leaves nothing behind: a process a test started that still runs at the end of
the run fails it, named (testkit/leftovers.py). A passing `make test` had left a local machine
running (its sandbox and agent), unnoticed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from testkit.processes import ROOT

LEAKY = """
import subprocess, sys

def test_that_forgets_its_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "left-by-a-test"])

def test_that_forgets_its_redis(tmp_path):  # (it writes over its environment: known by its folder)
    from catacloud.embedded import EmbeddedRedis

    EmbeddedRedis(tmp_path).start()

def test_that_cleans_up():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "stopped-by-its-test"])
    proc.kill()
    proc.wait()
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist-workers"])
def test_a_run_whose_test_leaves_a_process_running_fails_and_names_it(
    tmp_path: Path, workers: list[str]
) -> None:
    """Also under pytest-xdist (as `make test` runs): each worker's leftovers reach the run's end."""
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "testkit.leftovers", "-p", "no:django"]
        + ["-p", "no:cacheprovider", f"--basetemp={tmp_path / 'run'}", *workers, "test_leaky.py"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert run.returncode == 1, run.stdout + run.stderr  # every test passed, the run did not
    assert "3 passed" in run.stdout
    assert "what the tests left running or mounted" in run.stdout
    assert "left-by-a-test" in run.stdout and "stopped-by-its-test" not in run.stdout
    assert "(redis-server)" in run.stdout
    leaked = [p for p in psutil.process_iter(["cmdline"]) if "left-by-a-test" in (p.info["cmdline"] or [])]
    assert leaked == []  # and they were ended
    redis = [p for p in psutil.process_iter(["cwd"]) if str(p.info["cwd"]).startswith(str(tmp_path / "run"))]
    assert redis == []
