# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Series files and `git format-patch` mboxes as pure functions over bytes: parse, apply
with zero fuzz, trailers, version label, a patch's name, author and upstream subject. No I/O
here.

A patch's identity is its name, carried in the patch as a ``Patch-Name:`` trailer (stgit's patch
names, git-buildpackage's ``Gbp-Pq: Name``): the same in every series (primary, upstream
variants, backports), its file is ``<name>.patch`` there, and every key (series order, topics,
resolutions, apply records, probes) is that name. Editing a subject changes one line."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Optional, Sequence

from moe_release.common import UserError
from moe_release.series.pins import Base

LABEL_PREFIX = "moerelease"
REQUIRED_TRAILERS = ("Signed-off-by",)
STATUS_TRAILERS = ("Forwarded", "Applied-Upstream")
ORIGIN_TRAILER = "Origin"
NAME_TRAILER = "Patch-Name"
NAME_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")


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
    if NAME_TRAILER not in patch.trailers:
        missing.append(NAME_TRAILER)
    return missing


def name_of(patch: Patch) -> Optional[str]:
    """The name a patch carries (its ``Patch-Name:`` trailer); None where it carries none."""
    names = patch.trailers.get(NAME_TRAILER)
    return names[0].strip() if names else None


def primary_name(patch: Patch) -> str:
    """The primary series' patch ``patch`` is: ``<name>.patch`` of the name it carries (the same
    in every series), or its file name where it carries none (a plain git branch's commit)."""
    name = name_of(patch)
    return f"{name}.patch" if name else patch.name


def name_problems(patch: Patch) -> list[str]:
    """What is wrong with a patch's name: one ``Patch-Name:``, lower-case words joined by
    ``-``, and its file called ``<name>.patch``."""
    names = patch.trailers.get(NAME_TRAILER, [])
    if not names:
        return []  # check_trailers names the missing trailer
    if len(names) > 1:
        return [f"{patch.name}: has {len(names)} {NAME_TRAILER}: trailers, expected one"]
    name = names[0].strip()
    if not NAME_RE.match(name):
        return [
            f"{patch.name}: {NAME_TRAILER}: {name!r} is not lower-case words joined by '-' "
            "(e.g. flex-dispatcher-state)"
        ]
    if patch.name != f"{name}.patch":
        return [f"{patch.name}: carries {NAME_TRAILER}: {name}, so its file must be {name}.patch"]
    return []


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
    """Local version label: a hash of the base (its sdist's sha256 or its commit's tree), the
    series in order and the new modules."""
    digest = hashlib.sha256(base.identity.encode())
    for name, data in list(patches) + sorted(overlay):
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return f"{LABEL_PREFIX}.{len(patches)}.{digest.hexdigest()[:10]}"


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def patch_stem(file_name: str) -> str:
    """A patch file's name without ``.patch`` (the patch's name): its resolution is
    ``resolutions/<name>.diff``."""
    return file_name[: -len(".patch")] if file_name.endswith(".patch") else file_name


def patch_author(patch: Patch) -> tuple[str, str, str]:
    """A patch's author and date as (name, email, date), for git's ``GIT_AUTHOR_*``."""
    match = re.match(r"^(.*?)\s*<([^>]*)>$", patch.author)
    name, email = (match.group(1), match.group(2)) if match else (patch.author, "")
    return name, email, patch.date


def upstream_subject(subject: str) -> str:
    """``[MoE] Release x`` -> ``fix(moe): release x`` (acronyms keep their case); a backport's
    ``cp: `...` into `branch``` subject is already upstream's and is kept."""
    if subject.startswith("cp: `"):
        return subject
    text = re.sub(r"^\[MoE\]\s*", "", subject).strip()
    first = text.split(" ", 1)[0]
    if not (len(first) > 1 and (first.isupper() or any(c.isdigit() for c in first))):
        text = text[:1].lower() + text[1:]
    return f"fix(moe): {text}"
