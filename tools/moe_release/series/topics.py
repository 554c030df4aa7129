# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The upstream PRs the series is exported as, read from ``patches/topics.toml``.

The file holds what the series knows about its patches and PRs: each patch's topic and tests
(``[patch.<name>]``, by the name the patch carries), and
per topic, in merge order, the PRs that must merge before it, the upstream-layout tests it adds,
its PR text (``title``, ``summary``, ``related``), the flex backends its tests have cases for
(``backends``), and where a target branch says otherwise (``[topic.<name>.on.<target>]``:
those keys, and ``rename``, word changes of the exported subjects). A topic whose patch is
renamed upstream names the series' words for it (``subject``: matched inside a backport's
``cp: `...```) and upstream's (``upstream``). ``[test-file."<name>"]`` says when a test file is
exported (``requires``: only where the series changes that module) and with which message.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from pathlib import Path
from typing import Optional

from moe_release.common import REPO_ROOT, UserError

TOPICS_FILE = "patches/topics.toml"
# The memory PRs (every topic but the CPU-import fix) as one series, in series order.
MEMORY = "memory"
CPU_IMPORT = "cpu-import"
# The keys a topic's text may have, and those a target may override. ``not-forwarded``: why no
# upstream PR carries the topic's patches (DEP-3 ``Forwarded: not-needed``): the overlay's own.
# ``stands-aside``: "PATH: TEXT", a tree whose PATH holds TEXT already has what the topic's
# patches add (upstream's own form of it): apply leaves them out there.
TEXT_KEYS = (
    "title", "summary", "related", "design", "backends", "subject", "upstream", "not-forwarded",
    "stands-aside",
)  # fmt: skip
ON_KEYS = ("title", "summary", "related", "backends", "rename")
TEST_FILE_KEYS = ("requires", "message")
# A patch's table: its topic, the upstream-layout tests that show it (per_patch.py's), the
# probes (series/probes.py, "topic/name") whose promise it keeps in a merged tree, and its
# release code a series does not carry as the primary does (series/drift.py's), with why.
PATCH_KEYS = ("topic", "tests", "probes", "not-carried")
NOT_CARRIED_KEYS = ("series", "definitions", "why")


@dataclasses.dataclass(frozen=True)
class Topics:
    """patches/topics.toml: each patch's topic (by its file, ``<name>.patch``), and per
    topic, in merge order, the PRs that must merge before it, the test files it adds and its
    PR text."""

    of_patch: dict[str, str]
    prerequisites: dict[str, tuple[str, ...]]
    tests: dict[str, tuple[str, ...]]
    text: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    on: dict[tuple[str, str], dict] = dataclasses.field(default_factory=dict)
    test_files: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    probes: dict[str, str] = dataclasses.field(default_factory=dict)  # probe -> patch file
    # (series directory, "path::qualname") -> (patch file, why the series does not carry it)
    not_carried: dict[tuple[str, str], tuple[str, str]] = dataclasses.field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        """Every topic, in merge order."""
        return tuple(self.prerequisites)

    @property
    def forwarded(self) -> tuple[str, ...]:
        """The topics upstream PRs carry (all but the ``not-forwarded`` ones), in merge order."""
        return tuple(t for t in self.names if "not-forwarded" not in self.text.get(t, {}))

    @property
    def memory(self) -> tuple[str, ...]:
        """The memory PRs (every forwarded topic but the CPU-import fix), in merge order."""
        return tuple(t for t in self.forwarded if t != CPU_IMPORT)

    def choices(self) -> tuple[str, ...]:
        """What ``--topic`` takes: ``memory`` and every forwarded topic."""
        return (MEMORY, *self.forwarded)

    def closure(self, topic: str) -> tuple[str, ...]:
        """The PRs ``topic`` builds on, directly or through another, in merge order."""
        need, todo = set(), list(self.prerequisites.get(topic, ()))
        while todo:
            dep = todo.pop()
            if dep not in need:
                need.add(dep)
                todo += self.prerequisites[dep]
        return tuple(t for t in self.names if t in need)

    def get(self, topic: str, key: str, target: Optional[str] = None) -> Optional[str]:
        """``key`` of ``topic``'s text as ``target`` has it (its ``on`` table first)."""
        own = self.on.get((topic, target), {})
        return own[key] if key in own else self.text.get(topic, {}).get(key)

    def renames(self, target: str) -> list[tuple[str, str]]:
        """The word changes of exported subjects on ``target``, every topic's."""
        return [tuple(pair) for (_, t), own in self.on.items() if t == target
                for pair in own.get("rename", [])]  # fmt: skip

    def stands_aside(self, patch: str, files: dict) -> Optional[str]:
        """Why ``patch`` (a primary patch's name) is left out on a tree of ``files``: its
        topic's ``stands-aside`` text is in the tree; None where it applies."""
        rule = self.text.get(self.of_patch.get(patch, ""), {}).get("stands-aside")
        if not rule:
            return None
        path, _, text = rule.partition(": ")
        data = files.get(path)
        if data is None or text.encode() not in data:
            return None
        return f"stands aside: {path} has {text!r}"

    def renamed_topic(self, subject: str) -> Optional[str]:
        """The topic whose patch upstream calls otherwise, if ``subject`` is its patch's."""
        for topic, text in self.text.items():
            if text.get("subject") and text["subject"] in subject:
                return topic
        return None


def _string_list(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{where}: must be a list of strings")
    return tuple(value)


def _strings(table: dict, keys: tuple[str, ...], where: str) -> dict[str, str]:
    for key in keys:
        if key in table and not isinstance(table[key], str):
            raise UserError(f"{where}.{key}: must be a string")
    return {k: table[k] for k in keys if k in table}


def _on(name: str, table: object, where: str) -> dict[tuple[str, str], dict]:
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise UserError(f"{where}: wants one [topic.{name}.on.<target>] table per target")
    out = {}
    for target, own in table.items():
        at = f"{where}.{target}"
        extra = sorted(set(own) - set(ON_KEYS))
        if extra:
            raise UserError(f"{at}: unknown key {extra[0]!r} ({', '.join(ON_KEYS)})")
        entry: dict = _strings(own, ON_KEYS[:-1], at)
        rename = own.get("rename", [])
        if not isinstance(rename, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p)
            for p in rename
        ):
            raise UserError(f"{at}.rename: must be a list of [old, new] string pairs")
        if rename:
            entry["rename"] = rename
        out[(name, target)] = entry
    return out


@functools.lru_cache(maxsize=8)
def _load(path: Path, mtime_ns: int) -> Topics:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"{TOPICS_FILE}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{TOPICS_FILE}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - {"patch", "topic", "test-file", "patch-tests"})
    if unknown or not isinstance(data.get("topic"), dict) or not data["topic"]:
        raise UserError(
            f"{TOPICS_FILE}: wants [topic.<name>], [test-file.<name>], [patch.<name>] and "
            "[patch-tests] tables only"
        )
    prerequisites: dict[str, tuple[str, ...]] = {}
    tests: dict[str, tuple[str, ...]] = {}
    text: dict[str, dict[str, str]] = {}
    on: dict[tuple[str, str], dict] = {}
    keys = ("prerequisites", "tests", *TEXT_KEYS, "on")
    for name, table in data["topic"].items():
        where = f"{TOPICS_FILE}: topic.{name}"
        if name == MEMORY or not isinstance(table, dict):
            raise UserError(f"{where}: not a topic table ({MEMORY!r} is reserved)")
        extra = sorted(set(table) - set(keys))
        if extra:
            raise UserError(f"{where}: unknown key {extra[0]!r} ({', '.join(keys)})")
        deps = _string_list(table.get("prerequisites", []), f"{where}.prerequisites")
        for dep in deps:
            if dep not in prerequisites:
                raise UserError(
                    f"{where}.prerequisites: {dep!r} is not a topic declared before it "
                    "(topics are listed in merge order)"
                )
        prerequisites[name] = deps
        tests[name] = _string_list(table.get("tests", []), f"{where}.tests")
        text[name] = _strings(table, TEXT_KEYS, where)
        on.update(_on(name, table.get("on", {}), f"{where}.on"))
    if CPU_IMPORT not in prerequisites:
        raise UserError(f"{TOPICS_FILE}: no [topic.{CPU_IMPORT}]")
    of_patch, probes, not_carried = {}, {}, {}
    for name, table in data.get("patch", {}).items():
        where = f"{TOPICS_FILE}: patch.{name}"
        if not isinstance(table, dict) or set(table) - set(PATCH_KEYS):
            bad = sorted(set(table) - set(PATCH_KEYS))[0] if isinstance(table, dict) else table
            raise UserError(f"{where}: unknown key {bad!r} ({', '.join(PATCH_KEYS)})")
        topic = table.get("topic")
        if topic not in prerequisites:
            raise UserError(f"{where}: topic {topic!r} is not a declared topic")
        of_patch[f"{name}.patch"] = topic
        for probe in _string_list(table.get("probes", []), f"{where}.probes"):
            if probe in probes:
                raise UserError(f"{where}.probes: {probe!r} is also {probes[probe]}'s")
            probes[probe] = f"{name}.patch"
        for i, entry in enumerate(table.get("not-carried", [])):
            here = f"{where}.not-carried[{i}]"
            if not isinstance(entry, dict) or set(entry) != set(NOT_CARRIED_KEYS):
                raise UserError(f"{here}: wants exactly {', '.join(NOT_CARRIED_KEYS)}")
            why = _strings(entry, ("why",), here)["why"]
            for series in _string_list(entry["series"], f"{here}.series"):
                for definition in _string_list(entry["definitions"], f"{here}.definitions"):
                    if (series, definition) in not_carried:
                        raise UserError(f"{here}: {series} {definition} is listed twice")
                    not_carried[(series, definition)] = (f"{name}.patch", why)
    test_files = {}
    for name, table in data.get("test-file", {}).items():
        where = f"{TOPICS_FILE}: test-file.{name}"
        extra = sorted(set(table) - set(TEST_FILE_KEYS)) if isinstance(table, dict) else ["?"]
        if extra:
            raise UserError(f"{where}: unknown key {extra[0]!r} ({', '.join(TEST_FILE_KEYS)})")
        test_files[name] = _strings(table, TEST_FILE_KEYS, where)
    return Topics(dict(of_patch), prerequisites, tests, text, on, test_files, probes, not_carried)


def load_topics(root: Path = REPO_ROOT) -> Topics:
    """Read and check patches/topics.toml: every patch's topic is declared, and every topic's
    prerequisites are topics declared before it (merge order); a problem is one line naming
    it."""
    path = root / TOPICS_FILE
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        mtime = -1
    return _load(path, mtime)
