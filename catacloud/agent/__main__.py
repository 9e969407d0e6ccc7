"""``python -m catacloud.agent agent|job-meta|checkpoint ...`` without the rest of the ``catacloud`` CLI."""

from __future__ import annotations

import argparse
import sys

from catacloud.agent.main import add_agent_commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="catacloud")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_agent_commands(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
