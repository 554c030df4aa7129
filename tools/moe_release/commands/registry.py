# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The one registry of moe-release's commands.

Each module of :mod:`moe_release.commands` (but this one and :mod:`.cli`) is one command: it
defines its parser's arguments (``configure``) and its ``run``, and calls :func:`register` once.
The command's name is the module's with hyphens for underscores; its aliases are the names it had
as a script of its own. A command whose tool parses its own arguments (``own_parser``) gets the
words after its name unchanged, as ``args.argv``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import sys
from typing import Callable, Dict, List, Optional, Tuple

# The modules of the commands package that are not commands.
INFRASTRUCTURE = ("registry", "cli")


class RegistryError(Exception):
    """A command registered twice, under a taken name, or a module that is no command."""


def _nothing(parser: argparse.ArgumentParser) -> None:
    """A command without arguments of its own."""


@dataclasses.dataclass(frozen=True)
class Command:
    """One command: its name, one line of help, its parser's arguments and its run."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    configure: Callable[[argparse.ArgumentParser], None] = _nothing
    aliases: Tuple[str, ...] = ()
    # The parser's description (default: ``help``).
    description: Optional[str] = None
    # The tool parses its arguments itself: ``run`` gets them unparsed in ``args.argv``.
    own_parser: bool = False


class Registry:
    """Commands by name, each with the module that registered it."""

    def __init__(self) -> None:
        self._commands: Dict[str, Command] = {}
        self._modules: Dict[str, str] = {}  # command name -> the module that registered it
        self._words: Dict[str, str] = {}  # name or alias -> command name

    def register(self, command: Command, module: Optional[str] = None) -> Command:
        """Add ``command``, registered by ``module`` (default: the caller's module)."""
        module = module or sys._getframe(1).f_globals["__name__"]
        for word in (command.name, *command.aliases):
            if word in self._words:
                owner = self._modules[self._words[word]]
                raise RegistryError(f"{module}: {word!r} is taken (registered by {owner})")
        self._commands[command.name] = command
        self._modules[command.name] = module
        for word in (command.name, *command.aliases):
            self._words[word] = command.name
        return command

    def commands(self) -> List[Command]:
        """Every registered command, by name."""
        return [self._commands[name] for name in sorted(self._commands)]

    def module_of(self, name: str) -> str:
        """The module that registered the command ``name``."""
        return self._modules[name]

    def words(self) -> Dict[str, str]:
        """Every name and alias, with the name of the command it runs."""
        return dict(self._words)

    def load(self, package: str) -> List[str]:
        """Import every command module of ``package``; the problems found: a module that does
        not import, registers no command or more than one, or names its command otherwise than
        after itself."""
        problems = []
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            if info.name in INFRASTRUCTURE or info.name.startswith("_"):
                continue
            module = f"{package}.{info.name}"
            try:
                importlib.import_module(module)
            except RegistryError as exc:
                problems.append(str(exc))
                continue
            names = [n for n, m in self._modules.items() if m == module]
            if len(names) != 1:
                problems.append(f"{module}: registers {len(names)} commands {names}, not one")
            elif names[0] != info.name.replace("_", "-"):
                problems.append(f"{module}: registers {names[0]!r}, not its own name")
        return problems


REGISTRY = Registry()


def register(command: Command) -> Command:
    """Register ``command`` in :data:`REGISTRY`; each command module calls this once."""
    return REGISTRY.register(command, module=sys._getframe(1).f_globals["__name__"])


def commands() -> List[Command]:
    """Every command of :mod:`moe_release.commands`, each module imported once."""
    problems = REGISTRY.load(__package__)
    if problems:
        raise RegistryError("; ".join(problems))
    return REGISTRY.commands()
