"""`moe_release.py fetch`: the pinned sdist, verified, never a tampered or wrongly pinned one
in the cache."""

import pytest

from moe_release.common import UserError
from moe_release.series.pins import Base
from moe_release.series.sdist import fetch_sdist


def test_fetch_rejects_tampered_cache(tmp_path, base, sdist):
    cache = tmp_path / "cache"
    cache.mkdir()
    data = bytearray(sdist.read_bytes())
    data[1000] ^= 0xFF
    (cache / base.sdist).write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        fetch_sdist(base, cache)
    msg = str(err.value)
    assert base.sdist in msg and f"expected {base.sha256}" in msg and "got " in msg
    assert "megatron-core 0.19.2" in msg


def test_fetch_wrong_pin_downloads_nothing_into_cache(tmp_path, base):
    """A pin whose sha256 does not match PyPI's file: clear error, and nothing is cached."""
    wrong = Base(**{**base.__dict__, "sha256": "0" * 64})
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as err:
        fetch_sdist(wrong, cache)
    assert f"expected {'0' * 64}, got {base.sha256}" in str(err.value)
    assert list(cache.iterdir()) == []
