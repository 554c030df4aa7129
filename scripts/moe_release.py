#!/usr/bin/env python3
"""moe-release: maintain the MoE dispatcher patch series over a pinned megatron-core sdist.

Verbs:
  fetch        download the pinned sdist(s) into the cache and verify their sha256
  materialize  base sdist + series + this repo's new modules -> a complete patched tree
  edit         the same tree as a git repo: base commit (tag `base`) + one commit per patch
  export       write the commits of an `edit` repo back into the series (churn-free)
  check        every series applies with zero fuzz, round-trips byte-for-byte, has trailers
  verify       does an installed megatron-core match this repo's series?
  trees        materialize the base and patched trees the tests run against
  label        print the overlay version label of a base's series

The logic is pure functions over bytes (parse_series, parse_patch, apply_file_patch, ...); the
verbs are thin I/O around them so tests call both.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import py_compile
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path
from typing import Iterator, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
PINS_FILE = REPO_ROOT / "patches" / "pins.toml"
# New modules this repo adds to megatron-core live here, mirroring megatron-core's layout.
OVERLAY_DIRS = ("megatron/core/transformer/moe",)
MANIFEST_PATH = "megatron/core/_moe_release_manifest.json"
PACKAGE_INFO = "megatron/core/package_info.py"
LABEL_PREFIX = "moerelease"
REQUIRED_TRAILERS = ("Signed-off-by",)
STATUS_TRAILERS = ("Forwarded", "Applied-Upstream")
ORIGIN_TRAILER = "Origin"

# Fixed identities and dates make `edit` reproducible and `export` byte-stable.
BASE_IDENT = ("megatron-core sdist", "sdist@moe-release.invalid", "2000-01-01T00:00:00+00:00")
COMMITTER_IDENT = ("moe-release import", "import@moe-release.invalid")
GIT_AM_FLAGS = (
    "am",
    "--quiet",
    "--keep",
    "--keep-cr",
    "--no-3way",
    "--committer-date-is-author-date",
    "--whitespace=nowarn",
)
FORMAT_PATCH_FLAGS = (
    "--keep-subject",
    "--no-stat",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--no-renames",
    "--no-binary",
    "--no-numbered",
    "--no-thread",
    "--filename-max-length=64",
)


class UserError(Exception):
    """A problem with the user's input: reported as one line, no traceback."""


# --------------------------------------------------------------------------------------------
# Pins
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Series and patches (pure)
# --------------------------------------------------------------------------------------------


def parse_series(text: str, source: str = "series") -> list[str]:
    """Patch file names in order; `#` starts a comment, blank lines are ignored."""
    names: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if len(line.split()) != 1:
            raise UserError(f"{source}:{lineno}: expected one patch file name, got {line!r}")
        if "/" in line or line.startswith("."):
            raise UserError(f"{source}:{lineno}: {line!r} must be a plain file name")
        if re.match(r"\d{4}-", line):
            raise UserError(f"{source}:{lineno}: {line!r} has a numeric prefix; order lives here")
        if line in names:
            raise UserError(f"{source}:{lineno}: {line!r} is listed twice")
        names.append(line)
    return names


def series_header(text: str) -> str:
    """The leading comment block of a series file, kept when the series is rewritten."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith("#") or not line.strip():
            out.append(line)
        else:
            break
    return "".join(out)


@dataclasses.dataclass
class Hunk:
    """One `@@` hunk; lines keep their ' ', '-', '+' prefix and their line ending."""

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    header: str
    lines: list[bytes]


@dataclasses.dataclass
class FilePatch:
    """The changes to one file."""

    path: str
    new_file: bool = False
    deleted: bool = False
    new_mode: Optional[str] = None
    hunks: list[Hunk] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Patch:
    """A parsed `git format-patch` mbox."""

    name: str
    subject: str
    author: str
    date: str
    message: str
    trailers: dict[str, list[str]]
    files: list[FilePatch]


_HUNK_RE = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")
_TRAILER_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*): (.+)$")


def _unfold_headers(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    last = None
    for line in lines:
        if line[:1] in (" ", "\t") and last:
            headers[last] += " " + line.strip()
        elif ":" in line:
            key, value = line.split(":", 1)
            last = key.strip()
            headers[last] = value.strip()
    return headers


def parse_trailers(message: str) -> dict[str, list[str]]:
    """Trailers of the last paragraph of a commit message."""
    paragraphs = [p for p in re.split(r"\n\s*\n", message.strip()) if p.strip()]
    trailers: dict[str, list[str]] = {}
    if len(paragraphs) < 2:
        return trailers
    for line in paragraphs[-1].splitlines():
        match = _TRAILER_RE.match(line.strip())
        if not match:
            return {}
        trailers.setdefault(match.group(1), []).append(match.group(2))
    return trailers


def parse_patch(data: bytes, name: str) -> Patch:
    """Parse one mbox written by `git format-patch`."""
    lines = data.splitlines(keepends=True)
    if not lines or not lines[0].startswith(b"From "):
        raise UserError(f"{name}: not a git format-patch mbox (no 'From ' line)")
    i = 1
    header_lines = []
    while i < len(lines) and lines[i].strip():
        header_lines.append(lines[i].decode("utf-8").rstrip("\n"))
        i += 1
    headers = _unfold_headers(header_lines)
    for key in ("From", "Date", "Subject"):
        if key not in headers:
            raise UserError(f"{name}: mbox header lacks {key}:")
    body: list[str] = []
    i += 1
    while (
        i < len(lines)
        and lines[i].rstrip(b"\n") != b"---"
        and not lines[i].startswith(b"diff --git ")
    ):
        body.append(lines[i].decode("utf-8"))
        i += 1
    message = "".join(body)
    files: list[FilePatch] = []
    current: Optional[FilePatch] = None
    while i < len(lines):
        line = lines[i]
        if line.startswith(b"diff --git "):
            match = re.match(rb"^diff --git a/(\S+) b/(\S+)$", line.rstrip(b"\n"))
            if not match:
                raise UserError(f"{name}: cannot parse {line.decode(errors='replace').strip()!r}")
            if match.group(1) != match.group(2):
                raise UserError(f"{name}: renames are not supported ({match.group(1).decode()})")
            current = FilePatch(path=match.group(2).decode())
            files.append(current)
            i += 1
            continue
        if current is None:
            i += 1
            continue
        if line.startswith(b"new file mode "):
            current.new_file = True
            current.new_mode = line.split()[-1].decode()
        elif line.startswith(b"deleted file mode "):
            current.deleted = True
        elif line.startswith((b"GIT binary patch", b"Binary files ")):
            raise UserError(f"{name}: binary change to {current.path} is not supported")
        elif line.startswith(b"@@ "):
            match = _HUNK_RE.match(line.rstrip(b"\n"))
            if not match:
                raise UserError(f"{name}: malformed hunk header in {current.path}: {line!r}")
            old_len = int(match.group(2)) if match.group(2) is not None else 1
            new_len = int(match.group(4)) if match.group(4) is not None else 1
            hunk = Hunk(
                old_start=int(match.group(1)),
                old_len=old_len,
                new_start=int(match.group(3)),
                new_len=new_len,
                header=line.rstrip(b"\n").decode("utf-8", errors="replace"),
                lines=[],
            )
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                hline = lines[i]
                tag = hline[:1]
                if tag == b"\\":
                    _strip_newline(hunk)
                elif tag in (b" ", b"-", b"+") or hline in (b"\n",):
                    if hline == b"\n":  # an empty context line whose space was stripped
                        hline, tag = b" \n", b" "
                    hunk.lines.append(hline)
                    seen_old += tag in (b" ", b"-")
                    seen_new += tag in (b" ", b"+")
                else:
                    raise UserError(
                        f"{name}: hunk {len(current.hunks) + 1} of {current.path} is truncated"
                    )
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise UserError(
                    f"{name}: hunk {len(current.hunks) + 1} of {current.path} is truncated"
                )
            if i < len(lines) and lines[i].startswith(b"\\"):
                _strip_newline(hunk)
                i += 1
            current.hunks.append(hunk)
            continue
        i += 1
    if not files:
        raise UserError(f"{name}: contains no diff")
    return Patch(
        name=name,
        subject=headers["Subject"],
        author=headers["From"],
        date=headers["Date"],
        message=message,
        trailers=parse_trailers(message),
        files=files,
    )


def _strip_newline(hunk: Hunk) -> None:
    """Apply a '\\ No newline at end of file' marker to the hunk's last line."""
    last = hunk.lines[-1]
    if last.endswith(b"\n"):
        hunk.lines[-1] = last[:-1]


def apply_file_patch(old: Optional[bytes], fp: FilePatch, patch_name: str) -> Optional[bytes]:
    """Apply one file's hunks with zero fuzz and zero offset; None means the file is deleted."""
    if fp.new_file:
        if old is not None:
            raise UserError(f"{patch_name}: creates {fp.path}, which already exists")
        src: list[bytes] = []
    else:
        if old is None:
            raise UserError(f"{patch_name}: modifies {fp.path}, which does not exist in the tree")
        src = old.splitlines(keepends=True)
    out: list[bytes] = []
    pos = 0  # index into src of the next line not yet copied
    for number, hunk in enumerate(fp.hunks, 1):
        start = hunk.old_start - 1 if hunk.old_len else hunk.old_start
        expected = [line[1:] for line in hunk.lines if line[:1] in (b" ", b"-")]
        where = f"{patch_name}: hunk #{number} ({hunk.header}) of {fp.path}"
        if start < pos:
            raise UserError(f"{where}: overlaps the previous hunk")
        actual = src[start : start + len(expected)]
        if actual != expected:
            for k, (want, got) in enumerate(zip(expected, actual + [b""] * len(expected))):
                if want != got:
                    raise UserError(
                        f"{where} does not apply: line {start + k + 1} is {got.rstrip()!r}, "
                        f"expected {want.rstrip()!r}"
                    )
        out.extend(src[pos:start])
        out.extend(line[1:] for line in hunk.lines if line[:1] in (b" ", b"+"))
        pos = start + len(expected)
    out.extend(src[pos:])
    if fp.deleted:
        if out:
            raise UserError(f"{patch_name}: deletes {fp.path} but leaves content behind")
        return None
    return b"".join(out)


def check_trailers(patch: Patch) -> list[str]:
    """Names of required trailers the patch lacks."""
    missing = [t for t in REQUIRED_TRAILERS if t not in patch.trailers]
    if not any(t in patch.trailers for t in STATUS_TRAILERS):
        missing.append("/".join(STATUS_TRAILERS))
    if ORIGIN_TRAILER not in patch.trailers:
        missing.append(ORIGIN_TRAILER)
    return missing


def stamp_package_info(text: str, version: str) -> str:
    """Pin megatron.core.__version__ to the overlay version, VCS suffix included."""
    return (
        text.rstrip("\n")
        + "\n\n# moe-release: the overlay's version replaces any VCS suffix computed above,\n"
        + "# so the local label appears exactly once.\n"
        + f"__version__ = {version!r}\n"
    )


def overlay_label(
    base: Base, patches: Sequence[tuple[str, bytes]], overlay: Sequence[tuple[str, bytes]]
) -> str:
    """Local version label: a hash of the base, the series in order and the new modules."""
    digest = hashlib.sha256(base.sha256.encode())
    for name, data in list(patches) + sorted(overlay):
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return f"{LABEL_PREFIX}.{len(patches)}.{digest.hexdigest()[:10]}"


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Repository inputs
# --------------------------------------------------------------------------------------------


def read_series(base: Base, root: Path = REPO_ROOT) -> list[tuple[str, bytes]]:
    """(name, mbox bytes) of the series, checked for missing and unlisted files."""
    sdir = base.series_dir(root)
    series_file = sdir / "series"
    if not series_file.exists():
        raise UserError(f"{series_file}: no series file for base {base.version}")
    names = parse_series(series_file.read_text(), str(series_file))
    missing = [n for n in names if not (sdir / n).is_file()]
    if missing:
        raise UserError(f"{series_file}: lists {missing[0]}, which does not exist in {sdir}")
    unlisted = sorted(p.name for p in sdir.glob("*.patch") if p.name not in names)
    if unlisted:
        raise UserError(f"{sdir}/{unlisted[0]}: patch file is not listed in {series_file}")
    return [(n, (sdir / n).read_bytes()) for n in names]


def overlay_files(root: Path = REPO_ROOT) -> list[tuple[str, bytes]]:
    """(tree path, bytes) of the new modules this repo adds to megatron-core."""
    out = []
    for rel in OVERLAY_DIRS:
        directory = root / rel
        if not directory.is_dir():
            continue
        for path in sorted(directory.rglob("*")):
            if path.is_dir() or "__pycache__" in path.parts or path.name.startswith("."):
                continue
            if path.name == "__init__.py":
                raise UserError(
                    f"{path.relative_to(root)}: the overlay must not contain __init__.py "
                    "(it would shadow megatron-core on sys.path)"
                )
            out.append((str(path.relative_to(root)), path.read_bytes()))
    return out


# --------------------------------------------------------------------------------------------
# The sdist
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where verified sdists are kept."""
    env = os.environ.get("MOE_RELEASE_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "moe-release"


def log(msg: str) -> None:
    """Progress on stderr."""
    print(f"moe-release: {msg}", file=sys.stderr, flush=True)


def fetch_sdist(base: Base, cache: Optional[Path] = None, python: str = sys.executable) -> Path:
    """The verified sdist of `base`, downloaded into the cache if needed."""
    cache = cache or cache_dir()
    target = cache / base.sdist
    if target.exists():
        got = sha256_file(target)
        if got != base.sha256:
            raise UserError(
                f"{target}: sha256 mismatch for megatron-core {base.version}: expected "
                f"{base.sha256}, got {got} (delete the file to download it again)"
            )
        return target
    cache.mkdir(parents=True, exist_ok=True)
    log(f"downloading megatron-core {base.version} sdist from PyPI")
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [
            python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--no-build-isolation", "--quiet", "--dest", tmp, f"megatron-core=={base.version}",
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
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


# --------------------------------------------------------------------------------------------
# Materialize
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Tree:
    """A materialized tree in memory."""

    base: Base
    files: dict[str, bytes]
    patches: list[str]
    touched: list[str]  # files changed by the series
    overlay: list[str]  # files added from this repo
    label: str

    @property
    def version(self) -> str:
        """The overlay's PEP 440 version."""
        return f"{self.base.version}+{self.label}"


def build_tree(
    base: Base,
    base_files: dict[str, bytes],
    patches: Sequence[tuple[str, bytes]],
    overlay: Sequence[tuple[str, bytes]],
    stamp: bool = True,
    compile_check: bool = False,
) -> Tree:
    """Apply the series and add the overlay, in memory; raises UserError naming what failed."""
    files = dict(base_files)
    touched: list[str] = []
    for name, data in patches:
        patch = parse_patch(data, name)
        changed = []
        for fp in patch.files:
            new = apply_file_patch(files.get(fp.path), fp, name)
            if new is None:
                files.pop(fp.path, None)
            else:
                files[fp.path] = new
                changed.append(fp.path)
            if fp.path not in touched:
                touched.append(fp.path)
        if compile_check:
            _compile_sources(name, {p: files[p] for p in changed if p.endswith(".py")})
    names = []
    for rel, data in overlay:
        if rel in base_files:
            raise UserError(
                f"overlay file {rel} collides with upstream megatron-core {base.version}"
            )
        if rel in files:
            raise UserError(f"overlay file {rel} collides with a file created by the series")
        files[rel] = data
        names.append(rel)
    label = overlay_label(base, patches, overlay)
    tree = Tree(base, files, [n for n, _ in patches], touched, names, label)
    if stamp:
        files[PACKAGE_INFO] = stamp_package_info(
            files[PACKAGE_INFO].decode(), tree.version
        ).encode()
        if MANIFEST_PATH in base_files:
            raise UserError(f"{MANIFEST_PATH} collides with upstream megatron-core {base.version}")
        files[MANIFEST_PATH] = manifest_bytes(tree)
    return tree


def manifest_bytes(tree: Tree) -> bytes:
    """What this tree was built from, and the hashes `verify` compares."""
    hashed = sorted(set(tree.touched + tree.overlay + [PACKAGE_INFO]) & set(tree.files))
    manifest = {
        "name": "megatron-core",
        "version": tree.version,
        "base": {
            "version": tree.base.version,
            "sdist": tree.base.sdist,
            "sha256": tree.base.sha256,
            "tag": tree.base.tag,
        },  # fmt: skip
        "series": tree.patches,
        "files": {p: sha256_bytes(tree.files[p]) for p in hashed},
    }
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def _compile_sources(patch_name: str, sources: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for rel, data in sources.items():
            path = Path(tmp) / "src.py"
            path.write_bytes(data)
            try:
                py_compile.compile(str(path), cfile=str(Path(tmp) / "src.pyc"), doraise=True)
            except py_compile.PyCompileError as exc:
                raise UserError(
                    f"{patch_name}: {rel} does not compile after this patch: {exc.msg}"
                ) from None


def load_tree(
    version: Optional[str] = None,
    series: bool = True,
    root: Path = REPO_ROOT,
    compile_check: bool = False,
) -> Tree:
    """Pins + cached sdist + repo series + overlay -> Tree."""
    pins = load_pins(root / "patches" / "pins.toml")
    base = pins.get(version)
    patches = read_series(base, root) if series else []
    base_files = read_sdist(fetch_sdist(base))
    return build_tree(base, base_files, patches, overlay_files(root), compile_check=compile_check)


@contextlib.contextmanager
def atomic_directory(dest: Path) -> Iterator[Path]:
    """A fresh temp dir beside dest, renamed to dest when the block succeeds, removed if not.

    dest must be absent or an empty directory; nothing is left half-written either way.
    """
    dest = dest.absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest}: target exists and is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        yield tmp
        if dest.exists():
            dest.rmdir()
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_files(root: Path, files: dict[str, bytes]) -> None:
    """Write {relative path: bytes} under root."""
    for rel, data in sorted(files.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def write_tree_atomic(files: dict[str, bytes], dest: Path) -> None:
    """Write files under a fresh temp dir beside dest, then rename it into place."""
    with atomic_directory(dest) as tmp:
        write_files(tmp, files)


def materialize(
    dest: Path, version: Optional[str] = None, series: bool = True, root: Path = REPO_ROOT
) -> Tree:
    """Write a complete patched megatron-core tree to dest (which must be absent or empty)."""
    dest = dest.absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest}: target exists and is not empty")
    tree = load_tree(version, series=series, root=root)
    write_tree_atomic(tree.files, dest)
    return tree


def ensure_trees(root: Path = REPO_ROOT) -> tuple[Path, Path]:
    """(base tree, patched tree) under .build/trees, what tests and the report run against.

    The base tree is the pristine sdist plus this repo's new modules (no series). Each tree's
    directory is named by its version label, so a changed series or module gets a fresh one;
    trees of other labels are removed.
    """
    trees_dir = root / ".build" / "trees"
    base, patched = load_tree(series=False, root=root), load_tree(root=root)
    wanted = {f"base-{base.version}": base, patched.version: patched}
    for name, tree in wanted.items():
        if not (trees_dir / name).exists():
            log(f"materializing {trees_dir / name}")
            write_tree_atomic(tree.files, trees_dir / name)
    for old in trees_dir.iterdir():
        if old.name not in wanted:
            shutil.rmtree(old, ignore_errors=True)
    return trees_dir / f"base-{base.version}", trees_dir / patched.version


# --------------------------------------------------------------------------------------------
# Git: edit and export
# --------------------------------------------------------------------------------------------


def git_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """An environment that ignores the user's git config, so output is reproducible."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        LC_ALL="C",
        TZ="UTC",
        GIT_COMMITTER_NAME=COMMITTER_IDENT[0],
        GIT_COMMITTER_EMAIL=COMMITTER_IDENT[1],
    )
    env.update(extra or {})
    return env


def git(
    repo: Path, *args: str, env: Optional[dict[str, str]] = None, input: Optional[bytes] = None
) -> bytes:
    """Run git in repo; raise UserError with git's message on failure."""
    result = subprocess.run(
        ["git", "-C", str(repo), *args], env=env or git_env(), input=input, capture_output=True
    )
    if result.returncode != 0:
        msg = result.stderr.decode(errors="replace").strip() or result.stdout.decode(
            errors="replace"
        )
        raise UserError(f"git {args[0]} failed in {repo}: {msg.splitlines()[0] if msg else '?'}")
    return result.stdout


def create_edit_repo(
    dest: Path, base: Base, base_files: dict[str, bytes], patches: Sequence[tuple[str, bytes]]
) -> None:
    """Git repo at dest: the base as one commit tagged `base`, then one commit per patch."""
    with atomic_directory(dest) as tmp:
        write_files(tmp, base_files)
        git(tmp, "init", "--quiet", "--initial-branch=main")
        git(tmp, "config", "moerelease.base", base.version)
        git(tmp, "config", "core.autocrlf", "false")
        git(tmp, "add", "--all")
        name, email, date = BASE_IDENT
        env = git_env(
            dict(
                GIT_AUTHOR_NAME=name, GIT_AUTHOR_EMAIL=email, GIT_AUTHOR_DATE=date,
                GIT_COMMITTER_NAME=name, GIT_COMMITTER_EMAIL=email, GIT_COMMITTER_DATE=date,
            )
        )  # fmt: skip
        msg = (
            f"megatron-core {base.version} (PyPI sdist)\n\n"
            f"sdist: {base.sdist}\nsha256: {base.sha256}\nupstream: {base.tag} ({base.branch})\n"
        )
        git(tmp, "commit", "--quiet", "--no-verify", "-m", msg, env=env)
        git(tmp, "tag", "base")
        for patch_name, data in patches:
            parse_patch(data, patch_name)  # a clear error for malformed input before git sees it
            try:
                git(tmp, *GIT_AM_FLAGS, input=data)
            except UserError as exc:
                raise UserError(
                    f"{patch_name}: does not apply to megatron-core {base.version}: {exc}"
                ) from None


def format_patches(repo: Path) -> list[tuple[str, bytes]]:
    """(file name, mbox) for each commit after tag `base`, in order, names without numbers."""
    with tempfile.TemporaryDirectory() as tmp:
        out = git(repo, "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false",
                  "-c", "diff.algorithm=myers", "-c", "diff.indentHeuristic=true",
                  "format-patch",
                  *FORMAT_PATCH_FLAGS, "--output-directory", tmp, "base..HEAD")  # fmt: skip
        result = []
        for line in out.decode().splitlines():
            path = Path(line)
            name = re.sub(r"^\d{4}-", "", path.name)
            result.append((name, path.read_bytes()))
    names = [n for n, _ in result]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise UserError(f"two commits map to the same patch file name {dup}; reword one subject")
    return result


def export_series(repo: Path, root: Path = REPO_ROOT) -> tuple[Base, list[str], list[str]]:
    """Write the edit repo's commits back into the series dir; returns (base, written, deleted)."""
    repo = repo.absolute()
    try:
        version = git(repo, "config", "moerelease.base").decode().strip()
    except UserError:
        raise UserError(f"{repo}: not an edit repo made by `moe_release.py edit`") from None
    base = load_pins(root / "patches" / "pins.toml").get(version)
    if git(repo, "status", "--porcelain", "--untracked-files=no").strip():
        raise UserError(f"{repo}: has uncommitted changes; commit them first")
    patches = format_patches(repo)
    for name, data in patches:
        missing = check_trailers(parse_patch(data, name))
        if missing:
            raise UserError(f"{name}: commit lacks trailer(s) {', '.join(missing)}")
    sdir = base.series_dir(root)
    sdir.mkdir(parents=True, exist_ok=True)
    series_file = sdir / "series"
    old_text = series_file.read_text() if series_file.exists() else ""
    old_names = parse_series(old_text, str(series_file)) if old_text else []
    header = (
        series_header(old_text) or f"# Patch series over megatron-core {base.version}, in order.\n"
    )
    new_series = header + "".join(f"{n}\n" for n, _ in patches)
    written, deleted = [], []
    staged: list[tuple[Path, bytes]] = []
    for name, data in patches:
        path = sdir / name
        if not path.exists() or path.read_bytes() != data:
            staged.append((path, data))
            written.append(name)
    if old_text != new_series:
        staged.append((series_file, new_series.encode()))
    # Stage everything first, then move into place: a failure leaves the old series intact.
    tmp_paths = []
    try:
        for path, data in staged:
            tmp_path = path.with_name(f".{path.name}.tmp")
            tmp_path.write_bytes(data)
            tmp_paths.append((tmp_path, path))
    except BaseException:
        for tmp_path, _ in tmp_paths:
            tmp_path.unlink(missing_ok=True)
        raise
    for tmp_path, path in tmp_paths:
        os.replace(tmp_path, path)
    keep = {n for n, _ in patches}
    for name in old_names + [p.name for p in sdir.glob("*.patch")]:
        if name not in keep and (sdir / name).exists():
            (sdir / name).unlink()
            deleted.append(name)
    return base, written, deleted


# --------------------------------------------------------------------------------------------
# Check and verify
# --------------------------------------------------------------------------------------------


def check_base(base: Base, root: Path = REPO_ROOT) -> list[str]:
    """Problems with one base's series (empty when it is good)."""
    problems: list[str] = []
    try:
        patches = read_series(base, root)
    except UserError as exc:
        return [str(exc)]
    for name, data in patches:
        try:
            missing = check_trailers(parse_patch(data, name))
        except UserError as exc:
            problems.append(str(exc))
            continue
        if missing:
            problems.append(f"{name}: lacks trailer(s) {', '.join(missing)}")
    if problems:
        return problems
    base_files = read_sdist(fetch_sdist(base))
    try:
        build_tree(base, base_files, patches, overlay_files(root), compile_check=True)
    except UserError as exc:
        return [str(exc)]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "edit"
        try:
            create_edit_repo(repo, base, base_files, patches)
            exported = format_patches(repo)
        except UserError as exc:
            return [str(exc)]
    if [n for n, _ in exported] != [n for n, _ in patches]:
        problems.append(
            f"series order/names do not round-trip: {[n for n, _ in patches]} -> "
            f"{[n for n, _ in exported]}"
        )
    for (name, data), (_, again) in zip(patches, exported):
        if data != again:
            problems.append(f"{name}: import+export changes the file (run edit, then export)")
    return problems


def find_installed_core(python: str) -> tuple[Path, Optional[str]]:
    """(megatron/core directory, distribution version) as seen by `python`, without importing it."""
    code = (
        "import importlib.util, importlib.metadata, json\n"
        "spec = importlib.util.find_spec('megatron')\n"
        "locs = list(spec.submodule_search_locations) if spec else []\n"
        "isfile = __import__('os').path.isfile\n"
        "core = [l + '/core' for l in locs if isfile(l + '/core/__init__.py')]\n"
        "try:\n    v = importlib.metadata.version('megatron-core')\n"
        "except importlib.metadata.PackageNotFoundError:\n    v = None\n"
        "print(json.dumps({'core': core[0] if core else None, 'version': v}))\n"
    )
    result = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir()
    )
    if result.returncode != 0:
        raise UserError(f"{python}: cannot inspect the environment: {result.stderr.strip()[-200:]}")
    info = json.loads(result.stdout)
    if not info["core"]:
        raise UserError(f"{python}: megatron-core is not installed")
    return Path(info["core"]), info["version"]


def verify_installed(core_dir: Path, dist_version: Optional[str], tree: Tree) -> list[str]:
    """Mismatches between an installed megatron/core and the expected tree (empty: matches)."""
    problems = []
    root = core_dir.parent.parent
    if dist_version != tree.version:
        problems.append(
            f"installed distribution is megatron-core {dist_version}, expected {tree.version}"
        )
    expected = json.loads(tree.files[MANIFEST_PATH])["files"]
    for rel, digest in sorted(expected.items()):
        path = root / rel
        if not path.exists():
            problems.append(f"{rel}: missing")
        elif sha256_file(path) != digest:
            problems.append(f"{rel}: differs from the series")
    if not (root / MANIFEST_PATH).exists():
        problems.append(f"{MANIFEST_PATH}: missing (not a moe-release build)")
    return problems


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _cmd_fetch(args: argparse.Namespace) -> int:
    pins = load_pins()
    bases = pins.bases.values() if args.all else [pins.get(args.base)]
    for base in bases:
        path = fetch_sdist(base)
        print(f"{base.version}: {path} (sha256 {base.sha256[:12]}… verified)")
    return 0


def _cmd_materialize(args: argparse.Namespace) -> int:
    tree = materialize(Path(args.dir), args.base, series=not args.no_series)
    print(f"{args.dir}: megatron-core {tree.version}")
    print(f"  base: {tree.base.sdist} ({tree.base.tag}), sha256 verified")
    print(f"  patches: {len(tree.patches)}" + "".join(f"\n    {p}" for p in tree.patches))
    print(f"  new modules: {len(tree.overlay)}" + "".join(f"\n    {p}" for p in tree.overlay))
    return 0


def _cmd_edit(args: argparse.Namespace) -> int:
    base = load_pins().get(args.base)
    patches = read_series(base)
    create_edit_repo(Path(args.dir), base, read_sdist(fetch_sdist(base)), patches)
    print(f"{args.dir}: megatron-core {base.version} at tag `base`, {len(patches)} patch commit(s)")
    print("  edit with git (commit --fixup, rebase -i base), then run: export " + args.dir)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    base, written, deleted = export_series(Path(args.dir))
    if not written and not deleted:
        print(f"{base.series}: unchanged")
    for name in written:
        print(f"{base.series}/{name}: written")
    for name in deleted:
        print(f"{base.series}/{name}: deleted")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    pins = load_pins()
    versions = [args.base] if args.base else sorted(pins.bases, key=lambda v: v != pins.primary)
    failed = False
    for version in versions:
        base = pins.get(version)
        if not (base.series_dir() / "series").exists():
            if version == pins.primary:
                print(f"{version}: FAIL no series file in {base.series}")
                failed = True
            else:
                print(f"{version}: no series yet ({base.series})")
            continue
        log(f"checking the series for {version}")
        problems = check_base(base)
        n = len(read_series(base)) if not problems else None
        if problems:
            failed = True
            print(f"{version}: FAIL")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"{version}: OK ({n} patches apply with zero fuzz, round-trip, trailers present)")
    return 1 if failed else 0


def _cmd_verify(args: argparse.Namespace) -> int:
    core_dir, dist_version = find_installed_core(args.python)
    tree = load_tree(args.base)
    problems = verify_installed(core_dir, dist_version, tree)
    if problems:
        print(
            f"MISMATCH: megatron-core at {core_dir} does not match this repo's series "
            f"({tree.version})"
        )
        for problem in problems:
            print(f"  {problem}")
        return 1
    n = len(json.loads(tree.files[MANIFEST_PATH])["files"])
    print(f"OK: megatron-core {dist_version} at {core_dir} matches the series ({n} files hashed)")
    return 0


def _cmd_trees(args: argparse.Namespace) -> int:
    base, patched = ensure_trees()
    print(f"export MOE_RELEASE_BASE_TREE={shlex.quote(str(base))}")
    print(f"export MOE_RELEASE_TREE={shlex.quote(str(patched))}")
    return 0


def _cmd_label(args: argparse.Namespace) -> int:
    base = load_pins().get(args.base)
    patches = read_series(base) if not args.no_series else []
    print(f"{base.version}+{overlay_label(base, patches, overlay_files())}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="moe_release.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--base", help="base version from patches/pins.toml (default: primary)")
        return p

    p = verb("fetch", "download the pinned sdist into the cache and verify its sha256")
    p.add_argument("--all", action="store_true", help="every pinned base")
    p.set_defaults(func=_cmd_fetch)
    p = verb("materialize", "write base + series + new modules as a complete tree to DIR")
    p.add_argument("dir", metavar="DIR", help="target directory (absent or empty)")
    p.add_argument("--no-series", action="store_true", help="base and new modules only")
    p.set_defaults(func=_cmd_materialize)
    p = verb("edit", "create a git repo at DIR: base commit (tag `base`) + one commit per patch")
    p.add_argument("dir", metavar="DIR", help="target directory (absent or empty)")
    p.set_defaults(func=_cmd_edit)
    p = sub.add_parser("export", help="write an edit repo's commits back into the series",
                       description="write an edit repo's commits back into the series")  # fmt: skip
    p.add_argument("dir", metavar="DIR", help="a repo made by `edit`")
    p.set_defaults(func=_cmd_export)
    p = verb("check", "apply every series with zero fuzz, round-trip it, check trailers")
    p.set_defaults(func=_cmd_check)
    p = verb("verify", "report whether an installed megatron-core matches this repo's series")
    p.add_argument("--python", default=sys.executable, help="interpreter of the environment")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser(
        "trees",
        help="materialize the base and patched trees the tests run against, under .build/trees",
        description="materialize the base and patched trees under .build/trees; prints "
        "shell exports of MOE_RELEASE_BASE_TREE and MOE_RELEASE_TREE",
    )
    p.set_defaults(func=_cmd_trees)
    p = verb("label", "print the overlay version (base+label) of the series")
    p.add_argument("--no-series", action="store_true", help="label of the base + new modules only")
    p.set_defaults(func=_cmd_label)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: user errors are one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"moe_release.py {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
