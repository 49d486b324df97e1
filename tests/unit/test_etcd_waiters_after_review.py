"""A dead waiter's turn passes for every client, judged by etcd's clock (review finding).

Before: the grace after which a dead waiter's queue entry was deleted was counted in
memory by each store from when *it* first saw the entry, so a fresh ``Locks`` (a cron
job's ``keymutex run --timeout 0``, a web request) never saw it run out and was refused
(holder ``None``) until the dead waiter's etcd lease expired: its whole TTL.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

import keymutex
from keymutex.stores import etcd as etcd_store
from keymutex.stores.etcd import _Layout

pytestmark = pytest.mark.usefixtures("etcd_url")


@pytest.fixture
def namespace() -> str:
    return f"review-{uuid.uuid4().hex[:12]}"


def _post(etcd_url: str, path: str, body: dict[str, object]) -> dict[str, object]:
    reply = httpx.post("http://" + etcd_url.removeprefix("etcd://") + path, json=body, timeout=5)
    reply.raise_for_status()
    decoded = reply.json()
    assert isinstance(decoded, dict)
    return decoded


def _queue(etcd_url: str, namespace: str, key: str) -> list[dict[str, str]]:
    start, end = _Layout(namespace).queue(key)
    reply = _post(
        etcd_url,
        "/v3/kv/range",
        {"key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode()},
    )
    kvs = reply.get("kvs") or []
    assert isinstance(kvs, list)
    return kvs


def _wait_for_queue(etcd_url: str, namespace: str, key: str) -> list[dict[str, str]]:
    deadline = time.monotonic() + 15
    while not (entries := _queue(etcd_url, namespace, key)):
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.02)
    return entries


WAITER = textwrap.dedent(
    """
    import sys
    import keymutex

    url, namespace, key = sys.argv[1:4]
    with keymutex.Locks(url, namespace=namespace, owner="doomed") as locks:
        locks.acquire(key, ttl=120, timeout=300)
    """
)


@pytest.fixture
def waiter_process() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def test_a_fresh_clients_try_gets_the_key_soon_after_a_queued_waiter_died(
    etcd_url: str, namespace: str, waiter_process: list[subprocess.Popen[bytes]]
) -> None:
    with keymutex.Locks(etcd_url, namespace=namespace, owner="alice") as alice:
        held = alice.acquire("nightly", ttl=60, timeout=0)
        waiter = subprocess.Popen(
            [sys.executable, "-c", WAITER, etcd_url, namespace, "nightly"],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        waiter_process.append(waiter)
        (entry,) = _wait_for_queue(etcd_url, namespace, "nightly")
        time.sleep(1.5)  # waiting for real: its watch, its rechecks
        waiter.send_signal(signal.SIGKILL)
        waiter.wait(10)
        killed = time.monotonic()
        held.release()
        released = time.monotonic()

    # Every try from a client of its own, as cron jobs and web requests are: none has
    # seen the dead waiter's entry before.
    holders: list[keymutex.Holder | None] = []
    while True:
        with keymutex.Locks(etcd_url, namespace=namespace, owner="cron") as fresh:
            try:
                lease = fresh.acquire("nightly", ttl=60, timeout=0)
            except keymutex.Locked as refused:
                holders.append(refused.holder)
            else:
                fence = lease.fence
                lease.release()
                break
        assert time.monotonic() - released < 10, (
            f"still refused {time.monotonic() - killed:.1f} s after the waiter died"
        )
        time.sleep(0.25)
    got = time.monotonic()
    assert holders == [None] * len(holders)  # free all along, but the dead waiter queued
    # The dead waiter's lease went unrenewed for HANDOVER_GRACE (by etcd's clock): its
    # turn passed, for this client as for any. Its lease (120 s) is far from expiring.
    assert got - killed <= etcd_store.HANDOVER_GRACE + 3
    assert fence > held.fence
    assert all(kv["key"] != entry["key"] for kv in _queue(etcd_url, namespace, "nightly"))
    granted = _post(etcd_url, "/v3/lease/timetolive", {"ID": int(entry["lease"])})
    assert int(str(granted["TTL"])) > 60  # not by its expiry


PATIENT = textwrap.dedent(
    """
    import sys
    import keymutex

    url, namespace, key = sys.argv[1:4]
    with keymutex.Locks(url, namespace=namespace, owner="bob") as locks:
        lease = locks.acquire(key, ttl=60, timeout=60)
        print("got", lease.fence, flush=True)
        lease.release()
    """
)


def test_a_live_waiter_stalled_briefly_keeps_its_turn(
    etcd_url: str, namespace: str, waiter_process: list[subprocess.Popen[bytes]]
) -> None:
    """A live waiter keeps its etcd lease alive at each look (once a second), so no
    client judges its entry dead: stopped for a second just as the key is freed (a GC
    pause), it keeps its turn against fresh clients' tries, and gets the key first."""
    with keymutex.Locks(etcd_url, namespace=namespace, owner="alice") as alice:
        held = alice.acquire("doc", timeout=0)
        bob = subprocess.Popen(
            [sys.executable, "-c", PATIENT, etcd_url, namespace, "doc"],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            stdout=subprocess.PIPE,
        )
        waiter_process.append(bob)
        _wait_for_queue(etcd_url, namespace, "doc")
        time.sleep(2 * etcd_store.HANDOVER_GRACE)  # waiting for real, longer than the grace
        bob.send_signal(signal.SIGSTOP)
        try:
            held.release()
            tries = 0
            stopped_until = time.monotonic() + 1.0
            while time.monotonic() < stopped_until:
                with keymutex.Locks(etcd_url, namespace=namespace, owner="cron") as fresh:
                    with pytest.raises(keymutex.Locked) as refused:
                        fresh.acquire("doc", ttl=60, timeout=0)
                    assert refused.value.holder is None  # free, but bob's turn
                tries += 1
                time.sleep(0.1)
            assert tries >= 3
        finally:
            bob.send_signal(signal.SIGCONT)
        out, _ = bob.communicate(timeout=30)
        assert out.decode().startswith("got "), "bob's turn was passed"
        assert int(out.split()[1]) > held.fence
