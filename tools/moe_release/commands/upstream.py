# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Export the series for submission to NVIDIA/Megatron-LM, in upstream's conventions.

Upstream commits carry conventional subjects (``fix(moe): ...``) and only a ``Signed-off-by``
(DCO) of the person submitting; the overlay's ``Forwarded:``/``Origin:`` trailers and its
placeholder identity are bookkeeping of this repository and are dropped. Each exported file is
a ``git am``-able mbox (``0001-<slug>.patch`` ...) whose message is the PR description: what,
why, measured numbers, tests, what it does not cover. A PR that builds on others
(patches/topics.toml) is diffed on top of them and written with their exports under
``prerequisites/``; :func:`check_export` applies an export, its prerequisites first, to a
Megatron-LM checkout with ``git am`` and byte-compiles every file it touched.
"""

from __future__ import annotations

import argparse
import py_compile
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from moe_release.commands.registry import Command, register
from moe_release.common import REPO_ROOT, UserError
from moe_release.series.git import create_edit_repo, format_patches
from moe_release.series.patches import Patch, parse_patch, primary_name, upstream_subject
from moe_release.series.pins import Base
from moe_release.series.source import available, not_configured, read_base_files
from moe_release.series.targets import (
    BACKPORT_TARGETS,
    PRIMARY_TARGETS,
    target_base,
    target_series,
)
from moe_release.series.topics import CPU_IMPORT, MEMORY, TOPICS_FILE, Topics, load_topics
from moe_release.series.trees import check_target_dir, os_error

OVERLAY_TRAILERS = ("Forwarded", "Applied-Upstream", "Origin", "Patch-Name", "Signed-off-by")
# Upstream takes one PR per code-owner area and topic: the dispatcher-state release
# (token_dispatcher.py), the A2A-overlap state (the 1F1B schedule plan and its nodes), HybridEP's
# buffer per process group and the communication-buffer lifecycle (fused_a2a.py,
# parallel_state.py); the CPU-import fix is its own. Which patch is which topic, what each PR
# builds on, the tests it adds and its text: patches/topics.toml (:mod:`..topics`).
# Where an export writes the PRs its topic builds on: OUTDIR/prerequisites/<k>-<topic>/.
PREREQUISITES_DIR = "prerequisites"
# A paragraph of a series message that starts so is the overlay's own evidence (commands of this
# repository); the export, whose reader has only Megatron-LM, leaves it out.
OVERLAY_PARAGRAPH = "moe-release: "
# Domains reserved for documentation and testing (RFC 2606, RFC 6761): no mail is delivered
# there, so a sign-off with such an address certifies nothing. Top-level labels, and second-level
# domains (with their subdomains).
RESERVED_TLDS = ("invalid", "example", "test", "localhost")
RESERVED_DOMAINS = ("example.com", "example.net", "example.org")
# Upstream's dev branch titles its PRs "[Dev] ..."; the variant's series keeps the primary's
# subjects (its file names come from them), the export puts the prefix in the PR's title only,
# as `git am` strips a bracketed prefix from a commit's subject.
DEV_PREFIX = {"dev": "[Dev] "}
# Files added to upstream as they are (upstream-layout tests), and the message of the patch that
# adds them at the end of the memory topic (first line: its subject).
UPSTREAM_FILES_DIR = "patches/upstream"
UPSTREAM_TESTS_MESSAGE = "patches/upstream/tests-message.txt"


def is_placeholder_email(email: str) -> bool:
    """Whether ``email`` is in a domain reserved for documentation or testing (RFC 2606,
    RFC 6761: ``.invalid``, ``.example``, ``.test``, ``.localhost``, ``example.com/.net/.org``),
    or has no domain at all."""
    domain = email.rpartition("@")[2].strip().rstrip(".>").lower()
    if "@" not in email or "." not in domain:
        return True
    if domain.rsplit(".", 1)[-1] in RESERVED_TLDS:
        return True
    return any(domain == d or domain.endswith("." + d) for d in RESERVED_DOMAINS)


def identity(repo: Path = REPO_ROOT) -> tuple[str, str]:
    """The identity git signs off with (``git commit -s`` and ``format-patch -s`` sign as the
    committer): ``GIT_COMMITTER_NAME``/``GIT_COMMITTER_EMAIL`` first, then the ``committer.*``
    and ``user.*`` config, as ``git var GIT_COMMITTER_IDENT`` resolves them, without git's
    guess from the host name. Refuses none, or a placeholder address, naming the fix."""
    fix = (
        'set yours: git config user.name "Your Name" && git config user.email you@your.domain '
        "(or GIT_COMMITTER_NAME/GIT_COMMITTER_EMAIL)"
    )
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.useConfigOnly=true", "var", "GIT_COMMITTER_IDENT"],
        capture_output=True,
    )
    match = re.match(r"^(.*?) <(.*)> \d+ [+-]\d{4}$", done.stdout.decode().strip())
    if done.returncode != 0 or match is None or not match.group(1) or not match.group(2):
        raise UserError(f"no git identity to sign off with (user.name/user.email unset); {fix}")
    name, email = match.group(1), match.group(2)
    if is_placeholder_email(email):
        raise UserError(
            f"{email} is a placeholder (a domain reserved by RFC 2606/6761), which the DCO "
            f"cannot accept; {fix}"
        )
    return name, email


def export_subject(subject: str, target: str, topics: Optional[Topics] = None) -> str:
    """A series subject as the export to ``target`` writes it: :func:`upstream_subject`, with
    one colon after the type (``A2A overlap: drop x`` -> ``drop x in the A2A overlap``, also
    inside a backport's ``cp: `...```), a patch upstream calls otherwise under its upstream name,
    and the words ``target`` renames (patches/topics.toml)."""
    topics = topics or load_topics()
    text = upstream_subject(subject)
    for old, new in topics.renames(target):
        text = text.replace(old, new)
    renamed = topics.renamed_topic(subject)
    if renamed:
        own = topics.on.get((renamed, target), {}).get("title")
        if own:
            return f"fix(moe): {own}"
        # The series' words as the export spells them (a subject starts in lower case there).
        words = re.escape("l" + topics.get(renamed, "subject")).replace(r"\ ", r"\s+")
        text = re.sub(words, topics.get(renamed, "upstream"), text)
    return re.sub(r"fix\(moe\): A2A overlap: ([^`]+)", r"fix(moe): \1 in the A2A overlap", text)


def pr_title(target: str, topic: str, series: list, root: Path = REPO_ROOT) -> str:
    """The PR's title: its one commit's subject, or the topic's; ``[Dev]`` first on dev."""
    topics = load_topics(root)
    if len(series) == 1:
        subject = parse_patch(series[0][1], series[0][0]).subject
        title = export_subject(subject, target, topics)
    elif topics.get(topic, "title", target):
        title = f"fix(moe): {topics.get(topic, 'title', target)}"
    else:  # nothing of the topic on this branch
        title = f"fix(moe): {topics.get(CPU_IMPORT, 'upstream')}"
    return DEV_PREFIX.get(target, "") + title


def upstream_message(patch: Patch, name: str, email: str) -> str:
    """The message without the overlay's trailers, signed off by the exporter."""
    lines = patch.message.rstrip("\n").split("\n")
    trailer = re.compile("^(" + "|".join(OVERLAY_TRAILERS) + "): ")
    while lines and (trailer.match(lines[-1]) or not lines[-1].strip()):
        lines.pop()
    return without_overlay_paragraphs("\n".join(lines)) + f"\n\nSigned-off-by: {name} <{email}>\n"


def without_overlay_paragraphs(text: str) -> str:
    """``text`` without its paragraphs of overlay evidence (:data:`OVERLAY_PARAGRAPH`)."""
    paragraphs = text.split("\n\n")
    return "\n\n".join(p for p in paragraphs if not p.startswith(OVERLAY_PARAGRAPH))


def _slug(subject: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", subject).strip("-")[:52].rstrip("-")


def patch_topic(patch: Patch, topics: Topics) -> str:
    """The PR a patch belongs to, by its name in patches/topics.toml (the same in every
    series); a patch no topic claims is an error naming it."""
    topic = topics.of_patch.get(primary_name(patch))
    if topic:
        return topic
    raise UserError(f"{patch.name}: belongs to no upstream topic (add it to {TOPICS_FILE})")


def check_topic(topic: str, root: Path = REPO_ROOT, exported: bool = False) -> Topics:
    """The topics, once ``topic`` is known to be one (or ``memory``); else a UserError naming
    them. ``exported``: also one an upstream PR carries (not the overlay's own)."""
    topics = load_topics(root)
    if topic not in (MEMORY, *topics.names):
        raise UserError(f"unknown topic {topic!r} (one of {', '.join(topics.choices())})")
    if exported and topic not in topics.choices():
        why = topics.get(topic, "not-forwarded")
        raise UserError(f"topic {topic!r} is the overlay's own, no upstream PR: {why}")
    return topics


def topic_series(
    series: list[tuple[str, bytes]], topic: str, root: Path = REPO_ROOT
) -> list[tuple[str, bytes]]:
    """The patches of one upstream PR (a topic of patches/topics.toml), or of ``memory``: the
    memory PRs' patches together, in series order."""
    topics = check_topic(topic, root)
    out = []
    for name, data in series:
        mine = patch_topic(parse_patch(data, name), topics)
        if mine == topic or (topic == MEMORY and mine in topics.memory):
            out.append((name, data))
    return out


def prerequisites(
    target: str, topic: str, root: Path = REPO_ROOT, whole: Optional[list] = None
) -> list[str]:
    """The PRs ``topic``'s PR to ``target`` builds on (patches/topics.toml, transitively), in
    merge order: those with patches on ``target`` (``whole``: its series, if read already)."""
    topics = check_topic(topic, root)
    whole = target_series(target, root) if whole is None else whole
    return [dep for dep in topics.closure(topic) if topic_series(whole, dep, root)]


def rebase_alone(
    series: list[tuple[str, bytes]],
    base: Base,
    base_files: dict[str, bytes],
    first: Sequence[tuple[str, bytes]] = (),
) -> list:
    """``series`` (a part of a stacked series) as it applies to ``base`` on top of ``first``
    (the PRs it builds on, in merge order) without the rest: each diff made again, as ``edit``
    and ``export`` make them (:func:`create_edit_repo`, :func:`format_patches`), so that its
    ``index`` lines name blobs a checkout of the base has once ``first`` is applied (or that the
    part's earlier patches make), which ``git am -3`` needs to fall back to a 3-way merge.
    Returns ``series``' patches only; one that does not apply there is an error naming it."""
    stack = [*first, *series]
    paths = {fp.path for name, data in stack for fp in parse_patch(data, name).files}
    with tempfile.TemporaryDirectory(prefix="moe-release-alone-") as tmp:
        repo = Path(tmp) / "repo"
        create_edit_repo(repo, base, {p: d for p, d in base_files.items() if p in paths}, stack)
        again = format_patches(repo)[len(first) :]
    cut = lambda data: data.index(b"\ndiff --git ") + 1  # noqa: E731
    return [(n, d[: cut(d)] + a[cut(a) :]) for (n, d), (_, a) in zip(series, again, strict=True)]


def upstream_test_files(root: Path = REPO_ROOT) -> dict[str, bytes]:
    """The upstream-layout test files under ``patches/upstream/tests``, by their path in
    Megatron-LM (``tests/...``)."""
    top = root / UPSTREAM_FILES_DIR
    files = sorted(p for p in (top / "tests").rglob("*.py") if "__pycache__" not in p.parts)
    return {p.relative_to(top).as_posix(): p.read_bytes() for p in files}


def new_files_diff(files: dict[str, bytes]) -> bytes:
    """A ``git apply``-able diff that adds ``files`` (path -> content, text) as new files."""
    out = []
    for rel, data in sorted(files.items()):
        lines = data.decode().splitlines(keepends=True)
        span = "1" if len(lines) == 1 else f"1,{len(lines)}"
        out.append(f"diff --git a/{rel} b/{rel}\nnew file mode 100644\n--- /dev/null\n")
        out.append(f"+++ b/{rel}\n@@ -0,0 +{span} @@\n")
        out += ["+" + line for line in lines]
        if lines and not lines[-1].endswith("\n"):
            out.append("\n\\ No newline at end of file\n")
    return "".join(out).encode()


def topic_test_files(topic: str, root: Path = REPO_ROOT) -> dict[str, bytes]:
    """The upstream-layout test files ``topic`` adds (for ``memory``, those of its PRs);
    a test file patches/topics.toml names that does not exist is an error."""
    files = upstream_test_files(root)
    topics = check_topic(topic, root)
    tests = topics.tests
    names = tuple(n for t in topics.memory for n in tests[t]) if topic == MEMORY else tests[topic]
    files = {p: d for p, d in files.items() if p.rsplit("/", 1)[-1] in names}
    missing = set(names) - {p.rsplit("/", 1)[-1] for p in files}
    if missing:
        raise UserError(f"{UPSTREAM_FILES_DIR}/tests: no {sorted(missing)[0]} ({topic})")
    return files


# What the shared upstream-layout tests carry for older release branches only, and what they
# read on every other target: (file name, the branches that need the shim, the shim, what
# replaces it). The export to any other target writes the replacement, so main's and dev's
# PRs carry no release-branch code; a shim no longer found is an error naming it.
_SPEC_SHIM = (
    "\ntry:\n"
    "    from megatron.core.transformer.spec_utils import get_submodules\n"
    "except ImportError:  # core_r0.16.0: an MoE spec is a ModuleSpec\n"
    "    from operator import attrgetter\n\n"
    '    get_submodules = attrgetter("submodules")\n'
)
_SPEC_IMPORT = "from megatron.core.transformer.spec_utils import get_submodules\n"
TEST_SHIMS = [
    ("test_token_dispatcher_state_release.py", ("core_r0.16.0",), _SPEC_SHIM, ""),
    (
        "test_token_dispatcher_state_release.py", ("core_r0.16.0",),
        "from megatron.core.transformer.transformer_config import TransformerConfig\n",
        _SPEC_IMPORT
        + "from megatron.core.transformer.transformer_config import TransformerConfig\n",
    ),
    ("flex_buffer_utils.py", ("core_r0.16.0",), _SPEC_SHIM, ""),
    (
        "flex_buffer_utils.py", ("core_r0.16.0",),
        "from megatron.core.transformer.transformer_config import TransformerConfig\n",
        _SPEC_IMPORT
        + "from megatron.core.transformer.transformer_config import TransformerConfig\n",
    ),
    (
        "test_token_dispatcher_state_release.py", ("core_r0.16.0",),
        "    @pytest.mark.skipif(\n"
        "        # core_r0.16.0's is_te_min_version raises without Transformer Engine\n"
        '        get_te_version() is None or not is_te_min_version("2.1.0"),\n'
        '        reason="moe_permute_fusion needs TE 2.1",\n'
        "    )\n",
        '    @pytest.mark.skipif(not is_te_min_version("2.1.0"), reason="moe_permute_fusion needs '
        'TE 2.1")\n',
    ),
    (
        "test_token_dispatcher_state_release.py", ("core_r0.16.0",),
        "from megatron.core.utils import get_te_version, is_te_min_version\n",
        "from megatron.core.utils import is_te_min_version\n",
    ),
    (
        "test_token_dispatcher_state_release.py", ("core_r0.16.0", "core_r0.17.0"),
        "        try:\n"
        '            layer = build_flex_layer("hybridep", recompute=True, '
        "**SHARED_EXPERTS_OVERLAP)\n"
        "        except ValueError as exc:\n"
        "            # Up to core_r0.17.0 the shared-expert overlap is the all-to-all "
        "dispatcher's only.\n"
        '            if "only works with alltoall token dispatcher" not in str(exc):\n'
        "                raise\n"
        '            pytest.skip(f"this branch has no flex shared-expert overlap ({exc})")\n',
        '        layer = build_flex_layer("hybridep", recompute=True, **SHARED_EXPERTS_OVERLAP)\n',
    ),
    (
        "test_fused_a2a_release_comm_buffers.py", ("core_r0.16.0", "core_r0.17.0"),
        "                # By keyword: core_r0.17.0 requires these three, later branches default "
        "them.\n",
        "",
    ),
]  # fmt: skip


def without_shims(files: dict[str, bytes], target: str) -> dict[str, bytes]:
    """The upstream-layout test files as the export to ``target`` writes them: the release-branch
    shims of :data:`TEST_SHIMS` that ``target`` does not need replaced."""
    out = dict(files)
    for name, branches, shim, replacement in TEST_SHIMS:
        if target in branches:
            continue
        for path in [p for p in out if p.rsplit("/", 1)[-1] == name]:
            text = out[path].decode()
            if shim not in text:
                raise UserError(
                    f"{path}: the release-branch shim for {', '.join(branches)} is gone "
                    f"(commands/upstream.py TEST_SHIMS: {shim.strip().splitlines()[0]!r})"
                )
            out[path] = text.replace(shim, replacement, 1).encode()
    return out


def export_test_files(
    topic: str, series: list, root: Path = REPO_ROOT, target: Optional[str] = None
) -> dict[str, bytes]:
    """The upstream-layout test files a PR of ``topic`` adds on a target whose topic series is
    ``series``: none where the series is empty (no tests-only PR), and a file of
    ``[test-file]`` (patches/topics.toml) only where the series changes the module it requires;
    with ``target``, without the shims it does not need (:func:`without_shims`)."""
    if not series:
        return {}
    touched = {fp.path for name, data in series for fp in parse_patch(data, name).files}
    requires = load_topics(root).test_files

    def wanted(path: str) -> bool:
        module = requires.get(path.rsplit("/", 1)[-1], {}).get("requires")
        return module is None or module in touched

    files = {p: d for p, d in topic_test_files(topic, root).items() if wanted(p)}
    return without_shims(files, target) if target else files


def _tests_patch(
    topic: str, series: list, root: Path = REPO_ROOT, target: Optional[str] = None
) -> Optional[tuple[str, str, bytes]]:
    """(subject, message, diff) of the patch adding ``topic``'s upstream-layout tests (those of
    the memory PRs for ``memory``) on a target whose topic series is ``series``, or None."""
    files = export_test_files(topic, series, root, target)
    if not files:
        return None
    message = UPSTREAM_TESTS_MESSAGE
    if topic != "memory":
        message = message.replace(".txt", f"-{topic}.txt")
    names = {p.rsplit("/", 1)[-1] for p in files}
    own = load_topics(root).test_files
    if len(names) == 1 and own.get(next(iter(names)), {}).get("message"):
        message = own[names.pop()]["message"]
    if not (root / message).exists():
        raise UserError(f"{message}: missing (the message of the {topic} tests patch)")
    text = (root / message).read_text().strip("\n")
    subject, _, body = text.partition("\n")
    return subject.strip(), without_overlay_paragraphs(body.strip("\n")), new_files_diff(files)


def export_upstream(
    target: str,
    outdir: Path,
    ident: tuple[str, str],
    topic: str = MEMORY,
    root: Path = REPO_ROOT,
    notes: Optional[list] = None,
) -> list[Path]:
    """Write one topic of ``target``'s series (:func:`target_series`) as ``git am``-able mboxes
    and its ``PR.md`` into ``outdir`` (absent or empty); returns the mboxes' paths. A topic that
    is not the whole series is diffed again against the base with only the PRs it builds on
    (:func:`rebase_alone`), whose own exports go to ``outdir/prerequisites/<k>-<topic>/`` in
    merge order (:func:`prerequisite_exports`). Where the base's files are not available,
    ``notes`` gets a line saying so. All or nothing: a failure leaves ``outdir`` as it was."""
    whole = target_series(target, root)
    outdir = check_target_dir(outdir)
    deps = prerequisites(target, topic, root, whole)
    base_files: dict[str, dict[str, bytes]] = {}  # read once, for every PR written
    try:
        staged = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.tmp-", dir=outdir.parent))
    except OSError as exc:
        raise UserError(f"{outdir}: cannot create the target: {exc.strerror or exc}") from None
    try:
        paths = _write_pr(staged, target, topic, whole, ident, root, notes, base_files)
        for k, dep in enumerate(deps, 1):
            sub = staged / PREREQUISITES_DIR / f"{k}-{dep}"
            sub.mkdir(parents=True)
            _write_pr(sub, target, dep, whole, ident, root, notes, base_files)
        if outdir.exists():
            outdir.rmdir()
        staged.rename(outdir)
    except OSError as exc:
        shutil.rmtree(staged, ignore_errors=True)
        raise os_error(exc, str(outdir)) from None
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return [outdir / p.name for p in paths]


def _pr_series(
    target: str,
    topic: str,
    whole: list[tuple[str, bytes]],
    root: Path,
    notes: Optional[list],
    base_files: dict[str, dict[str, bytes]],
) -> list[tuple[str, bytes]]:
    """``topic``'s patches as its PR carries them: diffed against the base with only the PRs it
    builds on below it (the whole series' diffs, and a note, where the base is not readable)."""
    series = topic_series(whole, topic, root)
    if not 0 < len(series) < len(whole):
        return series
    base = target_base(target, root)
    if not available(base):
        note = (
            f"index lines name blobs of the whole series, not of {base.name} alone "
            f"(git am -3 cannot fall back): {not_configured(base)}"
        )
        if notes is not None and note not in notes:
            notes.append(note)
        return series
    if base.name not in base_files:
        base_files[base.name] = read_base_files(base)
    deps = prerequisites(target, topic, root, whole)
    first = [p for dep in deps for p in topic_series(whole, dep, root)]
    return rebase_alone(series, base, base_files[base.name], first)


def _write_pr(
    dest: Path,
    target: str,
    topic: str,
    whole: list[tuple[str, bytes]],
    ident: tuple[str, str],
    root: Path,
    notes: Optional[list],
    base_files: dict[str, dict[str, bytes]],
) -> list[Path]:
    """Write ``topic``'s PR to ``target`` (its mboxes, then ``PR.md``) into the empty directory
    ``dest``; returns the mboxes' paths."""
    series = _pr_series(target, topic, whole, root, notes, base_files)
    name, email = ident
    last_date = parse_patch(series[-1][1], series[-1][0]).date if series else ""
    tests = _tests_patch(topic, series, root, target)
    total = len(series) + (1 if tests else 0)
    paths = []
    for n, (fname, data) in enumerate(series, 1):
        patch = parse_patch(data, fname)
        subject = export_subject(patch.subject, target, load_topics(root))
        diff = data[data.index(b"\ndiff --git ") + 1 :]
        head = (
            "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            f"From: {name} <{email}>\nDate: {patch.date}\n"
            f"Subject: [PATCH {n}/{total}] {subject}\n\n"
        )
        body = upstream_message(patch, name, email)
        out = dest / f"{n:04d}-{_slug(subject)}.patch"
        out.write_bytes((head + body + "---\n").encode() + diff)
        paths.append(out)
    if tests:
        subject, body, diff = tests
        head = (
            "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            f"From: {name} <{email}>\nDate: {last_date}\n"
            f"Subject: [PATCH {total}/{total}] {subject}\n\n"
        )
        out = dest / f"{total:04d}-{_slug(subject)}.patch"
        signoff = f"\n\nSigned-off-by: {name} <{email}>\n"
        out.write_bytes((head + body + signoff + "---\n").encode() + diff)
        paths.append(out)
    if load_topics(root).get(topic, "summary"):
        (dest / PR_FILE).write_text(pr_description(target, topic, series, root), encoding="utf-8")
    return paths


def prerequisite_exports(outdir: Path) -> list[tuple[str, list[Path]]]:
    """The PRs an export in ``outdir`` builds on, as :func:`export_upstream` wrote them under
    ``outdir/prerequisites/``: (topic, its mboxes), in merge order."""
    top = outdir / PREREQUISITES_DIR
    found = []
    for sub in top.iterdir() if top.is_dir() else ():
        k, _, topic = sub.name.partition("-")
        if sub.is_dir() and k.isdigit() and topic:
            found.append((int(k), topic, sorted(sub.glob("*.patch"))))
    return [(topic, paths) for _, topic, paths in sorted(found)]


def apply_command(outdir: Path) -> str:
    """The ``git am`` command line that applies an export in ``outdir`` to a checkout of its
    target: the PRs it builds on first, in merge order, then its own."""
    dirs = [paths[0].parent for _, paths in prerequisite_exports(outdir) if paths]
    globs = [shlex.quote(str(d.absolute())) + "/*.patch" for d in [*dirs, outdir]]
    return "git am -3 " + " ".join(globs)


PR_FILE = "PR.md"


def pr_description(target: str, topic: str, series: list, root: Path = REPO_ROOT) -> str:
    """The PR's description in upstream's template (.github/pull_request_template.md): what it
    does, the linked issue, the pre-checks as they stand, the commits, the tests and how to run
    them, and what the change does not cover (each commit's own "Not covered", under its
    subject)."""
    topics = load_topics(root)
    summary, related = topics.get(topic, "summary", target), topics.get(topic, "related", target)
    whole = target_series(target, root)
    for dep in prerequisites(target, topic, root, whole):  # in merge order
        title = pr_title(target, dep, topic_series(whole, dep, root), root)
        related += f" Builds on \"{title}\" (`upstream --topic {dep}`), which must merge first."
    test_files = sorted(export_test_files(topic, series, root))
    # What pytest runs: the test modules, not the helper modules the PR adds beside them.
    run_files = [p for p in test_files if p.rsplit("/", 1)[-1].startswith("test_")]
    box = lambda done: "x" if done else " "  # noqa: E731
    out = [
        f"Title: {pr_title(target, topic, series, root)}",
        "",
        "- [ ] I, the PR author, have personally reviewed every line of this PR.",
        "",
        "# What does this PR do?",
        "",
        summary,
        "",
        "## Issue tracking",
        "",
        f"Linked issue: {related}",
        "",
    ]
    design = topics.get(topic, "design", target)
    if design:  # how the change fits what upstream and its peers already do
        out += ["## Design", "", design, ""]
    out += [
        "## Contribution process",
        "",
        "### Pre-checks",
        "",
        f"- [{box(test_files)}] I have added relevant unit tests",
        "- [ ] I have added relevant functional tests",
        "- [x] I have added proper typing to my code",
        "- [x] I have added relevant documentation (docstrings)",
        "- [ ] I have run the autoformatter.sh on my PR",
        "",
        f"## Commits (against {target})",
        "",
    ]
    not_covered = []
    for name, data in series:
        patch = parse_patch(data, name)
        first = patch.message.strip("\n").split("\n\n", 1)[0]
        subject = export_subject(patch.subject, target, topics)
        out += [f"- **{subject}**: " + " ".join(first.split()), ""]
        for par in patch.message.split("\n\n"):
            if par.startswith("Not covered"):
                text = re.sub(r"^Not covered( here)?:?\s*", "", " ".join(par.split()))
                not_covered.append(f"*{subject}*: {text}")
    out += ["## Tests", ""]
    if test_files:
        out += [f"- `{p}`" for p in test_files]
        if topic == "cpu-import":  # import-only tests: no GPU, no process group
            out += ["", "```sh", "pytest " + " ".join(run_files), "```", ""]
            out += ["They need no GPU and no process group. Each fails on the commit before the"]
            out += ["fix and passes on it (checked on CPU, on each target branch)."]
        else:
            backends = topics.get(topic, "backends", target)
            out += ["", "```sh", "torchrun --nproc-per-node 8 -m pytest " + " ".join(run_files)]
            out += ["```", "", "Not yet run on GPUs: that each fails on the commit before its fix"]
            out += ["and passes on it is unverified there. The tests need CUDA and 8 ranks, and"]
            out += [f"each flex case its backend ({backends}); they skip otherwise. Where it"]
            out += ["was checked: on 8 CPU ranks over gloo, with CUDA and those kernels emulated"]
            out += ["on the host (the emulation is not part of this PR)."]
    else:
        out += ["No upstream unit test in this PR yet; the commits name what was checked."]
    if target in PRIMARY_TARGETS + BACKPORT_TARGETS and topic != "cpu-import":
        out += ["", f"A cherry-pick into {target} of the same change on main: land it after"]
        out += ["the main PR has passed GPU CI (`/ok to test`); keep this PR in draft until then."]
    out += ["", "## Not covered", ""] + [f"- {n}" for n in not_covered] + [""]
    return "\n".join(out)


def check_checkout_dir(checkout: Path) -> None:
    """Refuse (UserError naming it) a CHECKOUT argument that is not an existing directory."""
    if not checkout.exists():
        raise UserError(f"{checkout}: checkout does not exist")
    if not checkout.is_dir():
        raise UserError(f"{checkout}: checkout is not a directory")


def check_export(
    patches: list[Path],
    checkout: Path,
    ref: Optional[str],
    ident: tuple[str, str],
    first: Sequence[tuple[str, list[Path]]] = (),
) -> list[str]:
    """``git am`` the export onto a scratch clone of ``checkout`` (at ``ref``, default HEAD),
    after ``first`` (the PRs it builds on, (topic, mboxes) in merge order, as
    :func:`prerequisite_exports` lists them), and byte-compile the Python files they touched;
    returns lines describing the result, a line per PR applied. Raises UserError naming the
    patch that does not apply."""
    if not patches:
        raise UserError("nothing to check: the export is empty")
    check_checkout_dir(checkout)
    env = {
        "GIT_AUTHOR_NAME": ident[0], "GIT_AUTHOR_EMAIL": ident[1],
        "GIT_COMMITTER_NAME": ident[0], "GIT_COMMITTER_EMAIL": ident[1],
        "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin:/usr/local/bin", "LC_ALL": "C",
    }  # fmt: skip

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)

    with tempfile.TemporaryDirectory(prefix="moe-upstream-check-") as tmp:
        work = Path(tmp) / "checkout"
        done = run("clone", "--quiet", "--shared", "--no-checkout", str(checkout), str(work),
                   cwd=Path(tmp))  # fmt: skip
        if done.returncode != 0:
            raise UserError(f"{checkout}: not a git repository ({done.stderr.strip()[:200]})")
        rev = ref or "HEAD"
        done = run("checkout", "--quiet", "--detach", rev, cwd=work)
        if done.returncode != 0:  # a branch of the checkout is a remote branch of the clone
            done = run("checkout", "--quiet", "--detach", f"origin/{rev}", cwd=work)
        if done.returncode != 0:
            raise UserError(f"{checkout}: no ref {rev!r}")
        commit = run("rev-parse", "HEAD", cwd=work).stdout.strip()
        touched: set = set()
        lines = []
        parts = [*((f"prerequisite {k}/{len(first)} {topic}: ", paths)
                   for k, (topic, paths) in enumerate(first, 1)),
             ("the PR: " if first else "", patches)]  # fmt: skip
        for k, (label, paths) in enumerate(parts):
            for path in paths:
                done = run("am", "--quiet", str(path), cwd=work)
                if done.returncode != 0:
                    run("am", "--abort", cwd=work)
                    why = (done.stdout + done.stderr).strip().splitlines()
                    raise UserError(f"{label}{path.name} does not apply to {rev} ({commit[:12]})"
                                    f"{' after the PRs before it' if k else ''}: "
                                    f"{why[0] if why else '?'}")  # fmt: skip
                names = run("show", "--name-only", "--format=", "HEAD", cwd=work).stdout.split()
                touched.update(names)
            where = f"to {rev} ({commit[:12]})" if k == 0 else "on top"
            lines.append(f"{label}{len(paths)} patches applied with git am {where}")
        failed = []
        for rel in sorted(t for t in touched if t.endswith(".py")):
            try:
                py_compile.compile(str(work / rel), doraise=True, cfile=str(Path(tmp) / "c.pyc"))
            except py_compile.PyCompileError as exc:
                failed.append(f"{rel}: {exc.msg.strip().splitlines()[-1]}")
        if failed:
            raise UserError(f"byte-compile failed after git am: {failed[0]}")
        return [*lines, f"{len(touched)} files touched, all Python ones byte-compile"]


def configure(parser: argparse.ArgumentParser) -> None:
    """The target, the output directory, the checkout to check it on and the topic."""
    parser.add_argument("target", metavar="TARGET", help="upstream ref the export is for")
    parser.add_argument("outdir", metavar="OUTDIR", help="target directory (absent or empty)")
    parser.add_argument(
        "--check", metavar="CHECKOUT", help="git am the export (prerequisites first) onto a clone"
    )
    parser.add_argument("--ref", help="ref of CHECKOUT to apply to (default: TARGET)")
    parser.add_argument("--topic", default="memory",
                        help="which PR (patches/topics.toml): dispatcher-state, a2a-overlap, "
                        "hybridep-groups, comm-buffers (which builds on dispatcher-state and "
                        "hybridep-groups: their exports go to OUTDIR/prerequisites/), cpu-import, "
                        "or memory (the first four as one series, the default)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Write the export (and its prerequisites), and check it on a clone if asked."""
    target_series(args.target)  # bad arguments first, before anything is written
    check_topic(args.topic, exported=True)
    outdir = check_target_dir(Path(args.outdir))
    if args.check:
        check_checkout_dir(Path(args.check))
    ident = identity()
    notes: list = []
    paths = export_upstream(args.target, outdir, ident, args.topic, notes=notes)
    print(f"wrote {len(paths)} {args.topic} patches for {args.target} to {outdir}, "
          f"signed off by {ident[0]} <{ident[1]}>")  # fmt: skip
    first = prerequisite_exports(outdir)
    if first:
        print(f"the {args.topic} PR builds on {len(first)} PRs, which must merge first; their "
              f"exports (as `upstream {args.target} DIR --topic T` writes them) are in "
              f"{outdir / PREREQUISITES_DIR}, in merge order:")  # fmt: skip
        for k, (dep, dep_paths) in enumerate(first, 1):
            print(f"  {k}. {dep}: {len(dep_paths)} patches in "
                  f"{outdir / PREREQUISITES_DIR / f'{k}-{dep}'}")  # fmt: skip
    for note in notes:
        print(f"note: {note}")
    if paths:
        what = ", prerequisites first" if first else ""
        print(f"to apply to {args.target}{what}: {apply_command(outdir)}")
    if args.check:
        lines = check_export(paths, Path(args.check), args.ref or args.target, ident, first)
        for line in lines:
            print(f"check: {line}")
    return 0


register(
    Command(
        name="upstream",
        help="export the series for NVIDIA/Megatron-LM: git am-able, DCO-signed, upstream style",
        description="write the series for TARGET (core_r0.19.0: the primary series; main, dev: "
        "their variants in patches/upstream/; core_r0.18.0, core_r0.17.0, core_r0.16.0: the "
        "backport series) as 0001-... mboxes into OUTDIR",
        configure=configure,
        run=run,
    )
)
