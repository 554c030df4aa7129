# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""moe-release: maintain the MoE dispatcher patch series over a pinned megatron-core sdist.

One command, ``moe-release VERB`` (``python scripts/moe_release.py VERB``), whose verbs are the
modules of :mod:`moe_release.commands`, each registered once (:mod:`.registry`): the series'
verbs (fetch, materialize, edit, export, check, verify, trees, label, landed, upstream, port,
apply, sweep, matrix) and the tools that parse their own arguments (plan, report, fault-matrix,
production-shape-terms, device-kernels, upstream-cpu, per-patch), which also answer to the names
of their scripts under ``scripts/``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import NoReturn, Optional, Sequence

from moe_release.commands.registry import commands
from moe_release.common import UserError
from moe_release.series.source import CHECKOUT_ENV

PROG = "moe_release.py"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error for an unknown verb or flag names the closest known one."""

    def error(self, message: str) -> NoReturn:
        word, known = None, []
        choice = re.search(r"invalid choice: '([^']*)'", message)
        if choice:
            word, known = choice.group(1), [str(c) for c in self._subparser_choices()]
        extra = re.search(r"unrecognized arguments: (\S+)", message)
        if extra:
            word = extra.group(1).split("=")[0]
            known = [o for p in (self, *self._subparser_choices().values())
                     for a in p._actions for o in a.option_strings]  # fmt: skip
        near = difflib.get_close_matches(word, known, n=1, cutoff=0.6) if word else []
        super().error(message + (f"; did you mean {near[0]}?" if near else ""))

    def _subparser_choices(self) -> dict:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subparser per registered command."""
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for command in commands():
        p = sub.add_parser(
            command.name,
            aliases=list(command.aliases),
            help=command.help,
            description=command.description or command.help,
            add_help=not command.own_parser,
        )
        command.configure(p)
        p.set_defaults(command=command)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: user errors are one line on stderr and exit status 2. A tool that parses its
    own arguments gets the words after its name as they are, and runs as its script did."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    command = args.command
    if command.own_parser:
        # Called by its name, the tool's usage line says so; by an alias (its old script's
        # name), it runs as that script did.
        args.argv = rest
        args.prog = f"{PROG} {command.name}" if args.verb == command.name else None
        return command.run(args)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "megatron_lm", None):
        os.environ[CHECKOUT_ENV] = args.megatron_lm
    try:
        return command.run(args)
    except UserError as exc:
        print(f"{PROG} {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
