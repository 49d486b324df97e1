"""Store URL -> driver (``keymutex._urls``): the entry points are read once per process, and a
scheme is case-insensitive."""

from __future__ import annotations

import subprocess
import sys

import pytest

import keymutex
from keymutex import _urls


def test_entry_points_are_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scanning the installed distributions costs milliseconds: not at every ``Locks()``."""
    _urls.driver_for("memory://")  # the registry is built (or was already)

    def scanned(**_: object) -> object:
        raise AssertionError("entry_points() was scanned again")

    monkeypatch.setattr(_urls, "entry_points", scanned)
    for _ in range(3):
        keymutex.Locks("memory://").close()
        assert _urls.driver_for("SQLITE:///x.db") is _urls.driver_for("sqlite:///y.db")
    with pytest.raises(ValueError, match="unknown store URL scheme 'nosuch'; known schemes: etcd"):
        _urls.driver_for("nosuch://")


def _error_without(module: str, url: str, *, registry_read: bool = False) -> str:
    """What ``Locks(url)`` raises in a fresh interpreter that cannot import ``module``
    (blocked before keymutex is imported, or after its store registry was read)."""
    block = f"sys.modules[{module!r}] = None"
    lines = ["import sys", block, "import keymutex"]
    if registry_read:
        lines = ["import sys", "import keymutex", "keymutex.Locks('memory://').close()", block]
    lines += [
        "try:",
        f"    keymutex.Locks({url!r})",
        "except ImportError as exc:",
        "    print(exc)",
    ]
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return result.stdout.strip() or result.stderr


def test_a_missing_client_library_names_the_extra_to_install() -> None:
    error = _error_without("redis", "redis+cluster://127.0.0.1:7000")
    assert "pip install 'keymutex[redis]'" in error


def test_a_missing_client_library_still_names_the_extra_after_the_registry_is_read() -> None:
    error = _error_without("pymemcache", "memcached://127.0.0.1:1", registry_read=True)
    assert "pip install 'keymutex[memcached]'" in error


def test_a_missing_client_library_is_named_by_its_extra_not_its_module() -> None:
    """pymongo's module is ``bson``: "the store needs 'bson'" sent users to PyPI's
    unrelated ``bson`` package, which breaks pymongo."""
    assert _error_without("bson", "mongodb://127.0.0.1:1") == (
        "the mongodb:// store needs its client library (module 'bson' is missing):"
        " pip install 'keymutex[mongodb]'"
    )


def test_a_scheme_in_capitals_names_the_same_store(redis_url: str) -> None:
    """Schemes are case-insensitive (RFC 3986): REDIS:// was taken for the Redis store,
    then refused by redis-py ("must specify one of the following schemes")."""
    pytest.importorskip("redis")
    upper = "REDIS" + redis_url.removeprefix("redis")
    with keymutex.Locks(upper, namespace="capitals") as locks:
        assert locks.url == redis_url
        locks.acquire("k", timeout=0).release()


def test_a_mongodb_url_in_capitals_is_taken_too() -> None:
    pytest.importorskip("pymongo")
    with keymutex.Locks("MongoDB://127.0.0.1:1/db", namespace="capitals") as locks:
        assert locks.url == "mongodb://127.0.0.1:1/db"


# -- passwords never shown (found by review: a ? or # in one, or a mistyped //, printed
# it in full in usage errors, "store … failed" messages and serve's start-up line) -----

SECRET = "s3cret"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:pa?ss-s3cret@127.0.0.1:1/db",
        "mongodb://u:pa#ss-s3cret@127.0.0.1:1/db",
        "redis://:pa#ss-s3cret@127.0.0.1:1/0",
        "etcd://root:pa#ss-s3cret@127.0.0.1:1",
        "zookeeper://root:pa/ss-s3cret@127.0.0.1:1",
        "redis:/u:s3cret@127.0.0.1:1/0",
        "postgresql:u:s3cret@127.0.0.1:1/db",
        "redis://u:s3c@ret@127.0.0.1:1/0",
        "redis://127.0.0.1:1/0?password=s3cret",
        # Found by the second review: secrets as other query options, a leading space.
        "postgresql://u@127.0.0.1:1/db?sslpassword=s3cret",
        "mongodb://127.0.0.1:1/?tlsCertificateKeyFilePassword=s3cret&w=1",
        "mongodb://h/?authMechanismProperties=AWS_SESSION_TOKEN:s3cret",
        "http://h:1?api_token=s3cret",
        " redis://u:s3cret@127.0.0.1:1/0",
    ],
)
def test_a_password_is_hidden_however_the_url_is_written(url: str) -> None:
    shown = _urls.redacted(url)
    assert SECRET not in shown
    assert "***" in shown
    assert shown.endswith(url.rsplit("@", 1)[-1]) or "=***" in shown


def test_urls_without_a_password_are_shown_as_they_are() -> None:
    for url in [
        "redis://127.0.0.1:6379/0",
        "sqlite:///tmp/a:b@c.db",
        "memory://x",
        "etcd://h:2379",
        "redis://h/0?client_name=a:b@c",  # a colon in the query is no user's
        "redis://h/0?passive=1",
    ]:
        assert _urls.redacted(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:pa?ss-s3cret@127.0.0.1:1/db",
        "redis://:pa#ss-s3cret@127.0.0.1:1/0",
        "redis://u:s3cr/et@127.0.0.1:1/0",
        "etcd://root:pa#ss-s3cret@127.0.0.1:1",
        "postgresql:u:s3cret@127.0.0.1:1/db",
    ],
)
def test_no_piece_of_a_password_reaches_an_error(url: str) -> None:
    """Through ``keymutex ls``: usage errors (exit 2) and store failures (exit 69)."""
    done = subprocess.run(
        [sys.executable, "-m", "keymutex", "ls", "--store", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode in (2, 69), said
    for piece in ("s3cret", "s3cr", "'pa'", "ss-"):
        assert piece not in said, said
