"""Settings come from SHOAL_* variables and an optional TOML file; the environment wins."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from shoal.config.settings import Settings
from shoal.errors import ConfigurationError


def test_environment_and_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("SHOAL_"):
            monkeypatch.delenv(name)
    config = tmp_path / "shoal.toml"
    config.write_text('max_batch_points = 500\ntenant = "from-file"\nstorage_uri = "s3://bucket/prefix"\n')
    monkeypatch.setenv("SHOAL_CONFIG", str(config))
    monkeypatch.setenv("SHOAL_TENANT", "from-env")
    monkeypatch.setenv("SHOAL_DATA_DIR", str(tmp_path / "home"))
    settings = Settings()
    assert settings.max_batch_points == 500
    assert settings.tenant == "from-env"
    assert settings.resolved_storage_uri == "s3://bucket/prefix"
    assert settings.data_dir == tmp_path / "home"
    monkeypatch.delenv("SHOAL_CONFIG")
    monkeypatch.chdir(tmp_path)  # ./shoal.toml is read when no file is named
    assert Settings().max_batch_points == 500
    monkeypatch.chdir("/")
    assert Settings().resolved_storage_uri == str(tmp_path / "home" / "storage")


def test_bad_settings_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_MAX_BATCH_POINTS", "0")
    with pytest.raises(ValidationError, match="max_batch_points"):
        Settings()


def test_a_named_config_file_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A mistyped SHOAL_CONFIG silently meant every default (and the embedded catalog: the wrong database).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHOAL_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigurationError, match=r"SHOAL_CONFIG: no such file: .*missing\.toml"):
        Settings()
    monkeypatch.setenv("SHOAL_CONFIG", str(tmp_path))
    with pytest.raises(ConfigurationError, match="SHOAL_CONFIG: not a file"):
        Settings()
    monkeypatch.delenv("SHOAL_CONFIG")
    assert Settings().tenant  # the implicit ./shoal.toml may be absent


def test_a_malformed_config_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("database_url = [\n")
    monkeypatch.setenv("SHOAL_CONFIG", str(config))
    with pytest.raises(ConfigurationError, match=r"bad\.toml is not valid TOML: Invalid value"):
        Settings()
    monkeypatch.delenv("SHOAL_CONFIG")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shoal.toml").write_bytes(b"\xff = 1\n")  # the implicit file too, once it is there
    with pytest.raises(ConfigurationError, match="shoal.toml is not valid TOML"):
        Settings()
