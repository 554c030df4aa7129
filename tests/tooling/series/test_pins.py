"""The pins (``patches/pins.toml``, ``moe_release.series.pins``): what a pin must hold, and the
bases the repository pins."""

import pytest

from moe_release.common import UserError
from moe_release.series.pins import parse_pins


def test_parse_pins_rejects_bad_entries():
    with pytest.raises(UserError, match="lacks sha256"):
        parse_pins('primary = "1"\n[bases."1"]\nsdist="x"\ntag="t"\nbranch="b"\nseries="p"\n')
    with pytest.raises(UserError, match="64 lowercase hex"):
        parse_pins(
            'primary = "1"\n[bases."1"]\nsdist="x"\nsha256="abc"\ntag="t"\nbranch="b"\nseries="p"\n'
        )
    with pytest.raises(UserError, match="primary base '2'"):
        parse_pins('primary = "2"\n')
    commit = 'commit="%s"\ntree="%s"\nversion="0.20.0"\nbranch="main"\nseries="p"\n'
    ok = parse_pins(
        'primary = "1"\n[bases."1"]\nsdist="x"\nsha256="%s"\ntag="t"\nbranch="b"\n'
        'series="p"\n[bases.m]\n' % ("0" * 64) + commit % ("a" * 40, "b" * 40)
    )
    assert ok.get("m").is_commit and ok.get("m").version == "0.20.0" and ok.get("m").ci
    with pytest.raises(UserError, match="base m: commit must be 40 lowercase hex"):
        parse_pins('primary = "m"\n[bases.m]\n' + commit % ("a" * 7, "b" * 40))
    with pytest.raises(UserError, match="base m lacks tree"):
        parse_pins(
            'primary = "m"\n[bases.m]\ncommit="%s"\nversion="1"\nbranch="b"\n'
            'series="p"\n' % ("a" * 40)
        )
    with pytest.raises(UserError, match="base m: unknown key"):
        parse_pins('primary = "m"\n[bases.m]\nsha256="x"\n' + commit % ("a" * 40, "b" * 40))


def test_pins_hold_primary_and_backport_bases(pins):
    assert pins.primary == "0.19.2"
    assert {v: (b.branch, b.identity[:8]) for v, b in pins.bases.items()} == {
        "0.19.2": ("core_r0.19.0", "de643eee"),
        "0.18.2": ("core_r0.18.0", "911216b7"),
        "0.18.0": ("core_r0.18.0", "8feff0cd"),
        "0.17.1": ("core_r0.17.0", "d4c86f3b"),
        "0.17.0": ("core_r0.17.0", "ff66c206"),
        "0.16.1": ("core_r0.16.0", "86522fea"),
        "main-d98e8a6": ("main", "3575bb50"),
        "dev-d48bd6b": ("dev", "24a79d30"),
    }
    main = pins.get("main-d98e8a6")
    assert main.is_commit and main.commit.startswith("d98e8a6") and main.version == "0.20.0"
    with pytest.raises(UserError, match="unknown base version '9.9'"):
        pins.get("9.9")
