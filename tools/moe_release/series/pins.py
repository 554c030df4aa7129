# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The pinned bases (patches/pins.toml): PyPI sdists (version, sdist, sha256, upstream tag) and
Megatron-LM commits (commit id, tree hash, package version), each with its series."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Optional

from moe_release.common import REPO_ROOT, UserError

PINS_FILE = REPO_ROOT / "patches" / "pins.toml"

SDIST_KEYS = ("sdist", "sha256", "tag", "branch", "series")
COMMIT_KEYS = ("commit", "tree", "version", "branch", "series")
OPTIONAL_KEYS = ("ci",)
# A release version as megatron/core/package_info.py spells one (the wheel's public version).
_VERSION_RE = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?")


@dataclasses.dataclass(frozen=True)
class Base:
    """One pinned upstream base: a PyPI release's sdist or a Megatron-LM commit.

    ``name`` is the pin's key (``--base NAME``, ``MOE_RELEASE_BASE``); ``version`` the
    megatron-core version the base's package_info.py carries, which the overlay's version
    (``<version>+moerelease...``) starts with. For a release both are the release's version.
    """

    name: str
    version: str
    branch: str
    series: str  # directory of the series, relative to the repository root
    sdist: str = ""
    sha256: str = ""
    tag: str = ""
    commit: str = ""  # a commit base: its full Megatron-LM commit id ...
    tree: str = ""  # ... and that commit's git tree hash (the whole repository's tree)
    ci: bool = True  # whether `run-tests` runs its release tests by default

    @property
    def is_commit(self) -> bool:
        """A Megatron-LM commit rather than a PyPI sdist."""
        return bool(self.commit)

    @property
    def identity(self) -> str:
        """What identifies the base's content: the sdist's sha256 or the commit's tree hash."""
        return self.tree if self.is_commit else self.sha256

    def describe(self) -> str:
        """The base in words, e.g. ``megatron-core 0.18.2 (megatron_core-0.18.2.tar.gz)``."""
        if self.is_commit:
            return f"Megatron-LM {self.branch} {self.commit[:12]} (megatron-core {self.version})"
        return f"megatron-core {self.version} ({self.sdist})"

    def series_dir(self, root: Path = REPO_ROOT) -> Path:
        """Directory holding this base's `series` file and patches."""
        return root / self.series


@dataclasses.dataclass(frozen=True)
class Pins:
    """The pinned bases and which one is primary."""

    primary: str
    bases: dict[str, Base]

    def get(self, version: Optional[str]) -> Base:
        """The base pinned as ``version`` (its name; the primary one if None)."""
        version = version or self.primary
        if version not in self.bases:
            known = ", ".join(self.bases)
            raise UserError(f"unknown base version {version!r} (pinned: {known})")
        return self.bases[version]


def _parse_base(name: str, entry: dict, source: str) -> Base:
    where = f"{source}: base {name}"
    commit = "commit" in entry
    required = COMMIT_KEYS if commit else SDIST_KEYS
    missing = [k for k in required if k not in entry]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}")
    unknown = sorted(set(entry) - set(required) - set(OPTIONAL_KEYS))
    if unknown:
        kind = "a commit base" if commit else "an sdist base"
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} for {kind}")
    if any(not isinstance(entry[k], str) for k in required):
        raise UserError(f"{where}: {', '.join(required)} must be strings")
    if "ci" in entry and not isinstance(entry["ci"], bool):
        raise UserError(f"{where}: ci must be true or false")
    fields = {k: entry[k] for k in required + tuple(k for k in OPTIONAL_KEYS if k in entry)}
    if commit:
        for key in ("commit", "tree"):
            if not re.fullmatch(r"[0-9a-f]{40}", entry[key]):
                raise UserError(f"{where}: {key} must be 40 lowercase hex digits (a full git id)")
        if not _VERSION_RE.fullmatch(entry["version"]):
            raise UserError(f"{where}: version {entry['version']!r} is not a release version")
        return Base(name=name, **fields)
    if not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
        raise UserError(f"{where}: sha256 must be 64 lowercase hex digits")
    return Base(name=name, version=name, **fields)


def parse_pins(text: str, source: str = "pins.toml") -> Pins:
    """Parse the pin file."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{source}: invalid TOML: {exc}") from None
    bases = {
        name: _parse_base(name, entry, source) for name, entry in data.get("bases", {}).items()
    }
    primary = data.get("primary")
    if primary not in bases:
        raise UserError(f"{source}: primary base {primary!r} is not among the bases")
    if bases[primary].is_commit:
        raise UserError(f"{source}: the primary base {primary} must be a PyPI sdist")
    return Pins(primary=primary, bases=bases)


def load_pins(path: Path = PINS_FILE) -> Pins:
    """Read and parse the pin file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror or exc}") from None
    return parse_pins(text, str(path))
