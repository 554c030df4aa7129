"""The tooling's settings (``scripts/patchtool/settings.py``): one accessor per variable, read
when called."""

import pytest

from patchtool import settings


def test_docstring_lists_every_accessor():
    """The module docstring's table names each public accessor."""
    doc = settings.__doc__
    accessors = [
        name
        for name, value in vars(settings).items()
        if callable(value)
        and not name.startswith("_")
        and getattr(value, "__module__", None) == settings.__name__
        and name not in ("SettingError", "override")
    ]
    assert accessors
    missing = [name for name in accessors if f":func:`{name}`" not in doc]
    assert not missing, missing


def test_defaults(monkeypatch):
    for name in ("MOE_RELEASE_TREE", "MOE_RELEASE_FORK", "MOE_RELEASE_DEVICE_BARRIER_TIMEOUT",
                 "UPSTREAM_CPU_PG_TIMEOUT", "MOE_RELEASE_BASES", "UPSTREAM_CPU_TE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert settings.tree() is None
    assert settings.fork() is True
    assert settings.device_barrier_timeout() == 30.0
    assert settings.upstream_cpu_pg_timeout() == 180.0
    assert settings.bases() == []
    assert settings.upstream_cpu_te() == ""


def test_read_at_call_time(monkeypatch):
    monkeypatch.setenv("MOE_RELEASE_TREE", "/some/tree")
    monkeypatch.setenv("MOE_RELEASE_FORK", "0")
    monkeypatch.setenv("MOE_RELEASE_DEVICE_BARRIER_TIMEOUT", "1.5")
    monkeypatch.setenv("MOE_RELEASE_BASES", "a, b c")
    assert settings.tree() == "/some/tree"
    assert settings.fork() is False
    assert settings.device_barrier_timeout() == 1.5
    assert settings.bases() == ["a", "b", "c"]


def test_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("MOE_RELEASE_DEVICE_BARRIER_TIMEOUT", "soon")
    with pytest.raises(settings.SettingError, match="MOE_RELEASE_DEVICE_BARRIER_TIMEOUT"):
        settings.device_barrier_timeout()
    monkeypatch.delenv("MOE_RELEASE_TREE", raising=False)
    with pytest.raises(settings.SettingError, match="MOE_RELEASE_TREE is not set"):
        settings.tree(required=True)


def test_override_restores(monkeypatch):
    monkeypatch.delenv("MOE_RELEASE_PLACEMENT", raising=False)
    with settings.override("MOE_RELEASE_PLACEMENT", "0"):
        assert settings.placement() is False
    assert settings.placement() is True
    monkeypatch.setenv("MOE_RELEASE_PLACEMENT", "1")
    with settings.override("MOE_RELEASE_PLACEMENT", "0"):
        assert settings.placement() is False
    assert settings.placement() is True
