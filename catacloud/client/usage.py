"""Command-line parsing with the habits of gh and kubectl: "did you mean" for a mistyped command,
option or choice, and the global flags (``--url``, ``--profile``, ``--json``) before or after
the subcommand."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<got>[^']*)' \(choose from (?P<choices>.*)\)")


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean --follow?)`` for the closest candidates, or ``""``."""
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def did_you_mean_choice(word: str, choices: Iterable[str]) -> str:
    """Like :func:`did_you_mean` for a value among fixed choices, more forgiving: the choices
    that start with ``word`` (``wait``: waiting_for_machine), else the closest (``sucess``)."""
    choices = sorted(set(choices))
    starting = [c for c in choices if word and c.startswith(word.lower())]
    close = starting[:2] or difflib.get_close_matches(word.lower(), choices, n=2, cutoff=0.5)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    """The commands a parser's subparsers list in its help (not the hidden ones)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return [choice.dest for choice in action._choices_actions]
    return []


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors suggest the closest command, option or choice, and
    list the commands of a group named without one (``catacloud jobs``). Subparsers made by
    ``add_subparsers()`` are of this class too."""

    def error(self, message: str) -> NoReturn:
        found = _INVALID_CHOICE.search(message)
        if found:
            choices = [c.strip().strip("'") for c in found["choices"].split(",")]
            if message.startswith("argument COMMAND:"):  # a mistyped command (hidden ones unnamed)
                visible = _commands(self) or choices
                listed = ", ".join(f"'{c}'" for c in visible)
                message = message[: found.start("choices")] + listed + message[found.end("choices") :]
                message += did_you_mean(found["got"], visible)
            else:  # a value of an option
                message += did_you_mean_choice(found["got"], choices)
        elif message.startswith("the following arguments are required: COMMAND") and _commands(self):
            sys.stderr.write(self.format_help() + "\n")
            self.exit(2, f"{self.prog}: error: name a command: {', '.join(_commands(self))}\n")
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            # The command's own parser knows its options (set_defaults(_parser=...)).
            leaf: Parser = getattr(parsed, "_parser", None) or self
            options = [o for o in leaf._option_string_actions if o.startswith("--")]
            hints = "".join(did_you_mean(e.split("=")[0], options) for e in extras if e.startswith("-"))
            leaf.error(f"unrecognized arguments: {' '.join(extras)}{hints}")
        return parsed


def add_global_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``--url``, ``--profile`` and ``--json`` on the top parser (``catacloud --url … jobs ls``)
    and again on every client command (``catacloud jobs ls --url …``): a command's copy has no
    default, so it only overrides the top's when given."""
    kw: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument("--url", help="API base URL (default: CATACLOUD_URL, else the profile's)", **kw)
    parser.add_argument("--profile", help="profile of the config file (default: CATACLOUD_PROFILE)", **kw)
    parser.add_argument("--json", action="store_true", help="print the API's JSON (for scripts)", **kw)
