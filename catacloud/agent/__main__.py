"""``python -m catacloud.agent agent|job-meta|checkpoint ...`` without the rest of the ``catacloud`` CLI."""

from __future__ import annotations

import argparse
import importlib
import sys

from catacloud.agent.command import add_agent_commands


def main(argv: list[str] | None = None) -> int:
    """The ``catacloud`` command of the catacloud-agent distribution: with the server package
    installed (``catacloud.cli`` importable) the whole CLI, else the agent's own commands."""
    if __name__ != "__main__":  # run as the `catacloud` script, not `python -m catacloud.agent`
        try:  # an optional extension found at run time: the agent does not depend on the server
            full_cli = importlib.import_module("catacloud.cli").main
        except ImportError:
            pass
        else:
            return int(full_cli(argv))
    parser = argparse.ArgumentParser(prog="catacloud")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_agent_commands(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
