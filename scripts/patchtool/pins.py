# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The pinned bases (patches/pins.toml): version, sdist, sha256, upstream tag, series."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Optional

from .common import REPO_ROOT, UserError

PINS_FILE = REPO_ROOT / "patches" / "pins.toml"


@dataclasses.dataclass(frozen=True)
class Base:
    """One pinned upstream release."""

    version: str
    sdist: str
    sha256: str
    tag: str
    branch: str
    series: str  # directory of the series, relative to the repository root

    def series_dir(self, root: Path = REPO_ROOT) -> Path:
        """Directory holding this base's `series` file and patches."""
        return root / self.series


@dataclasses.dataclass(frozen=True)
class Pins:
    """The pinned bases and which one is primary."""

    primary: str
    bases: dict[str, Base]

    def get(self, version: Optional[str]) -> Base:
        """The base for `version` (the primary one if None)."""
        version = version or self.primary
        if version not in self.bases:
            known = ", ".join(sorted(self.bases))
            raise UserError(f"unknown base version {version!r} (pinned: {known})")
        return self.bases[version]


def parse_pins(text: str, source: str = "pins.toml") -> Pins:
    """Parse the pin file."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{source}: invalid TOML: {exc}") from None
    bases = {}
    for version, entry in data.get("bases", {}).items():
        missing = [k for k in ("sdist", "sha256", "tag", "branch", "series") if k not in entry]
        if missing:
            raise UserError(f"{source}: base {version} lacks {', '.join(missing)}")
        if not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
            raise UserError(f"{source}: base {version}: sha256 must be 64 lowercase hex digits")
        bases[version] = Base(
            version=version, **{k: entry[k] for k in Base.__annotations__ if k != "version"}
        )
    primary = data.get("primary")
    if primary not in bases:
        raise UserError(f"{source}: primary base {primary!r} is not among the bases")
    return Pins(primary=primary, bases=bases)


def load_pins(path: Path = PINS_FILE) -> Pins:
    """Read and parse the pin file."""
    return parse_pins(path.read_text(), str(path))
