# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The pinned sdist: download into the cache, verify its sha256, read its files."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

from moe_release import settings
from moe_release.common import UserError, log
from moe_release.series.pins import Base


def cache_dir() -> Path:
    """Where verified sdists are kept."""
    return settings.cache_dir()


def fetch_sdist(base: Base, cache: Optional[Path] = None, python: str = sys.executable) -> Path:
    """The verified sdist of `base`, downloaded into the cache if needed."""
    cache = cache or cache_dir()
    if cache.exists() and not cache.is_dir():
        raise UserError(f"{cache}: the sdist cache is not a directory (MOE_RELEASE_CACHE?)")
    target = cache / base.sdist
    if target.exists():
        got = sha256_file(target)
        if got != base.sha256:
            raise UserError(
                f"{target}: sha256 mismatch for megatron-core {base.version}: expected "
                f"{base.sha256}, got {got} (delete the file to download it again)"
            )
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
        download = tempfile.TemporaryDirectory(dir=cache, prefix=".download-")
    except OSError as exc:
        raise UserError(f"{cache}: cannot write the sdist cache: {exc.strerror or exc}") from None
    log(f"downloading megatron-core {base.version} sdist from PyPI")
    with download as tmp:
        cmd = [
            python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--no-build-isolation", "--quiet", "--dest", tmp, f"megatron-core=={base.version}",
        ]  # fmt: skip
        # Some sdists' setup.py runs `python3 -m pybind11` while pip prepares metadata: put this
        # interpreter's directory first on PATH so that `python3` is the one with the build tools.
        env = dict(os.environ, PATH=os.pathsep.join([str(Path(python).parent), os.environ["PATH"]]))
        result = subprocess.run(cmd, capture_output=True, text=True, env=env)
        got_path = Path(tmp) / base.sdist
        if result.returncode != 0 or not got_path.exists():
            detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"could not download {base.sdist}: {detail}")
        got = sha256_file(got_path)
        if got != base.sha256:
            raise UserError(
                f"{base.sdist}: sha256 mismatch for megatron-core {base.version}: expected "
                f"{base.sha256}, got {got}"
            )
        os.replace(got_path, target)
    return target


def read_sdist(path: Path) -> dict[str, bytes]:
    """Files of an sdist, top-level directory stripped; egg-info and PKG-INFO dropped."""
    files: dict[str, bytes] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) < 2 or not parts[1]:
                continue
            rel = parts[1]
            if not member.isfile():
                if member.isdir():
                    continue
                raise UserError(f"{path.name}: unsupported member {member.name}")
            if rel == "PKG-INFO" or rel.split("/", 1)[0].endswith(".egg-info"):
                continue
            if rel.startswith("/") or ".." in rel.split("/"):
                raise UserError(f"{path.name}: unsafe member {member.name}")
            f = tar.extractfile(member)
            assert f is not None
            files[rel] = f.read()
    return files


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
