"""Conflicts the tool settles region by region (``moe_release.series.settle``), on the merges
``git merge-file --diff3`` makes of small files shaped like the sweep's conflicts."""

from moe_release.series.merge import MARK_OURS, MARK_THEIRS, merge_file, settle_file
from moe_release.series.settle import settle_adjacent, settle_region

CLASS = b"class D:\n    def __init__(self):\n        self.x = 1\n\n"
TAIL = b"    def combine(self, h):\n        return h\n"


def _lines(text: bytes) -> list[bytes]:
    return text.splitlines(keepends=True)


def test_ref_lacks_the_context_beside_the_patchs_insertion():
    """main 81770cb015ea: the series' base has a method REF lacks, and the patch inserts a new
    one right after it. Both apply: the new method, without the one REF never had."""
    newer = b"    def zero_copy(self):\n        return None\n\n"
    added = b"    def reset(self):\n        self.x = None\n\n"
    base = CLASS + newer + TAIL
    theirs = CLASS + newer + added + TAIL
    ours = CLASS + TAIL
    data, n = merge_file(ours, base, theirs)
    assert n == 1
    settled, left = settle_adjacent(merge_file(ours, base, theirs, diff3=True)[0])
    assert (settled, left) == (CLASS + added + TAIL, 0)


def test_ref_inserts_a_line_above_lines_the_patch_rewrites():
    """main 54f90af07666: REF adds a keyword argument right above the lines the patch
    rewrites; both apply, REF's line first."""
    base = b"def f(kw):\n    kw['a'] = 1\n    # old comment\n    buf = make(**kw)\n"
    ours = base.replace(b"    # old comment\n", b"    kw['b'] = 2\n    # old comment\n")
    theirs = base.replace(b"    # old comment\n", b"    # new comment\n    drop()\n")
    assert merge_file(ours, base, theirs)[1] == 1
    data, left, how = settle_file(ours, base, theirs, *merge_file(ours, base, theirs))
    assert left == 0 and how == "changes side by side, both applied"
    assert (
        data == b"def f(kw):\n    kw['a'] = 1\n    kw['b'] = 2\n    # new comment\n    drop()\n"
        b"    buf = make(**kw)\n"
    )


def test_both_insert_new_methods_at_one_point():
    """dev c0c4fdc45e9f: REF and the patch each add methods at the same place of a class; both
    are kept, REF's first, a blank line between; a name in common or any other statement
    stays a conflict."""
    ref = [b"    def get_attr(self):\n", b"        return 1\n"]
    ours_add = [b"    @staticmethod\n", b"    def reset():\n", b"        pass\n", b"\n"]
    assert settle_region(ref, [], ours_add) == [*ref, b"\n", *ours_add]
    same = [b"    def get_attr(self):\n", b"        return 2\n", b"\n"]
    assert settle_region(ref, [], same) is None
    assert settle_region(ref, [], [b"    x = 1\n"]) is None  # not a module's constant
    assert settle_region([b"A = 1\n"], [], [b"B = {}\n", b"\n", b"def g():\n", b"    pass\n"]) == [
        b"A = 1\n",
        b"\n",
        b"B = {}\n",
        b"\n",
        b"def g():\n",
        b"    pass\n",
    ]


def test_what_touches_stays_a_conflict():
    """Both change one base line; both insert statements at one point: left for a person,
    written back with two-way markers (no base section), the other region still settled."""
    assert settle_region([b"a = 2\n"], [b"a = 1\n"], [b"a = 3\n"]) is None
    assert settle_region([b"x()\n", b"k\n"], [b"k\n"], [b"y()\n", b"k\n"]) is None
    base = b"one\n\ntwo\nkeep\n\nthree\n"
    ours = b"one changed\n\nkeep\n\nthree\n"  # changes 'one', drops 'two'
    theirs = b"one other\n\ntwo\nadded\nkeep\n\nthree\n"  # changes 'one', adds after 'two'
    merged, _ = merge_file(ours, base, theirs, diff3=True)
    data, left = settle_adjacent(merged)
    assert left >= 1 and MARK_OURS in data and MARK_THEIRS in data and b"|||||||" not in data
