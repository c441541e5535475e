"""URLs in settings: a password is masked however it is spelt (a base64 one holds "/"; "?" and "#" too, which
SQLAlchemy takes as part of it), and a Redis URL redis cannot use is refused at start naming SHOAL_REDIS_URL,
without its password (it was accepted, then `shoal settings` and every command printing it raised a traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy.engine import make_url

from shoal.config.settings import Settings, mask_url


@pytest.mark.parametrize("password", ["s3cr/et", "pa?ss", "pa#ss", "plain", "a/b+c=="])
def test_a_catalog_password_is_masked_however_it_is_spelt(password: str) -> None:
    url = f"postgresql://postgres:{password}@/shoal?host=/tmp/pg"
    assert make_url(url).password == password  # what the catalog connects with
    shown = mask_url(url)
    assert password not in shown and "***" in shown
    assert shown.startswith("postgresql://postgres:***@")


def test_mask_url_never_raises_and_shows_nothing_of_a_url_it_cannot_read() -> None:
    assert mask_url("redis://:topsecret@[::1") == "redis://***"
    assert mask_url("postgresql://u@h/db?password=zz") == "postgresql://u@h/db?password=***"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert mask_url("redis:///0") == "redis:///0"


@pytest.mark.parametrize(("url", "says"), [
    ("redis://:topsecret@[::1", "is not a URL redis can use"),
    ("http://127.0.0.1:6379", "must specify one of the following schemes"),
    ("redis://h:abc/0", "is not a URL redis can use"),
    ("REDIS://127.0.0.1:6379/0", "must specify one of the following schemes"),
    ("redis://127.0.0.1:6379/0?db=x", "Invalid value for 'db'"),
])
def test_a_redis_url_redis_cannot_use_is_refused_naming_the_setting(url: str, says: str, tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(redis_url=url, data_dir=tmp_path)
    text = str(refused.value)
    assert "SHOAL_REDIS_URL" in text and says in text and "topsecret" not in text
    # The command line says so in one line, no traceback (it printed one from `shoal settings`).
    done = subprocess.run([sys.executable, "-m", "shoal.cli", "settings"], capture_output=True, text=True,
                          timeout=120, env={"SHOAL_REDIS_URL": url, "SHOAL_DATA_DIR": str(tmp_path),
                                            "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "Traceback" not in done.stderr and "topsecret" not in done.stderr + done.stdout
    assert "SHOAL_REDIS_URL" in done.stderr


@pytest.mark.parametrize("url", ["redis://:pw@127.0.0.1:6379/0", "rediss://127.0.0.1/1", "unix:///tmp/v.sock",
                                 "redis:///0", "redis://:pw@/0"])
def test_redis_urls_redis_takes_are_accepted(url: str, tmp_path: Path) -> None:
    assert Settings(redis_url=url, data_dir=tmp_path).redis_url == url


@pytest.mark.parametrize("url", ["redis://:RSec@ret4@127.0.0.1:6390/0", "redis://default:p@ss@word@cache.internal:6379/0"])
def test_a_redis_password_holding_an_at_sign_is_masked_whole(url: str) -> None:
    """redis-py (urllib) ends the user part at the last `@` of the host part; masking stopped at the first and
    `shoal settings` showed `redis://:***@ret4@...`."""
    import redis

    password = redis.connection.parse_url(url)["password"]
    shown = mask_url(url)
    assert "@" in password and password not in shown
    assert all(piece not in shown for piece in password.split("@"))
    assert shown.endswith("***@" + url.rpartition("@")[2])


@pytest.mark.parametrize(("query", "says"), [("port=abc", "its port 'abc' is not a number"),
                                             ("port=99999", "has port 99999: a port is 1..65535"),
                                             ("port=5432,x", "its port 'x' is not a number")])
def test_a_port_given_as_a_query_parameter_is_checked_like_the_other(query: str, says: str) -> None:
    """`?port=abc` passed the settings check and every command then printed SQLAlchemy's 133-line traceback."""
    with pytest.raises(ValidationError, match=says):
        Settings(database_url=f"postgresql://u:pw@/shoal?host=/tmp&{query}")
    Settings(database_url="postgresql://u:pw@/shoal?host=/tmp,/var/run&port=5433,")  # libpq's lists stay valid
