"""The Redis test topologies themselves: they start, serve, fail over and leave nothing behind.

These run real ``redis-server``/``redis-sentinel`` processes (tests/_redis_servers.py);
they are skipped when Redis is not installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

import _redis_servers as servers
from _redis_fixtures import require_redis


@pytest.fixture(autouse=True)
def _needs_redis() -> None:
    require_redis()


def _gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _refuses(port: int) -> bool:
    return not servers._answers_ping(port)


def test_standalone_answers_then_stops_and_frees_its_port(tmp_path: Path) -> None:
    with servers.standalone(tmp_path) as server:
        pid = server.process.pid  # type: ignore[union-attr]
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        with server.client() as client:
            client.set("greeting", "hello")
            assert client.get("greeting") == "hello"
        assert server.info("persistence")["aof_enabled"] == "0"
    assert not server.alive
    assert _gone(pid)
    assert _refuses(server.port)


def test_a_failing_block_still_stops_the_server(tmp_path: Path) -> None:
    started: list[servers.RedisServer] = []

    def failing_test() -> None:
        with servers.standalone(tmp_path) as server:
            started.append(server)
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        failing_test()
    (server,) = started
    assert _gone(server.process.pid)  # type: ignore[union-attr]
    assert server not in servers._running


def test_a_paused_server_answers_nothing_until_resumed(tmp_path: Path) -> None:
    with servers.standalone(tmp_path) as server:
        server.pause()
        with (
            redis.Redis(port=server.port, socket_timeout=0.2, retry=None) as client,
            pytest.raises(redis.TimeoutError),
        ):
            client.ping()
        server.resume()
        with server.client() as client:
            assert client.ping() is True
        server.pause()  # stop() must cope with a paused server
    assert not server.alive


def test_restart_with_appendonly_keeps_what_was_acknowledged(tmp_path: Path) -> None:
    with servers.standalone(tmp_path, appendonly=True) as server:
        port = server.port
        with server.client() as client:
            client.set("kept", "yes")
            client.incr("counter", 41)
        server.kill()  # no shutdown: only the fsynced AOF remains
        assert _refuses(port)
        server.restart()
        assert server.port == port
        with server.client() as client:
            assert client.get("kept") == "yes"
            assert client.incr("counter") == 42


def test_restart_without_persistence_starts_empty(tmp_path: Path) -> None:
    with servers.standalone(tmp_path) as server:
        with server.client() as client:
            client.set("lost", "yes")
        server.kill()
        server.restart()
        with server.client() as client:
            assert client.get("lost") is None


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    server = servers.RedisServer(tmp_path / "bad", ["no-such-directive yes"])
    with pytest.raises(servers.TopologyError, match="no-such-directive") as failure:
        server.start()
    assert "exited" in str(failure.value)
    assert not server.alive


def test_no_server_survives_a_killed_test_process(tmp_path: Path) -> None:
    # The parent-death signal: even SIGKILL of pytest itself leaves no server behind.
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(Path(servers.__file__).parent)!r})
        import _redis_servers
        server = _redis_servers.standalone(Path({str(tmp_path)!r}))
        print(server.process.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not _gone(pid)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while not _gone(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"redis-server {pid} outlived the process that started it")
        time.sleep(0.01)


def test_cluster_serves_keys_of_every_master(tmp_path: Path) -> None:
    with servers.cluster(tmp_path, masters=3) as topology:
        assert topology.url == "redis+cluster://" + ",".join(
            f"127.0.0.1:{node.port}" for node in topology.nodes
        )
        masters = topology.masters()
        assert len(masters) == 3
        keys_by_owner: dict[int, list[str]] = {master.port: [] for master in masters}
        number = 0
        while any(len(keys) < 5 for keys in keys_by_owner.values()):
            key = f"key:{number}"
            keys_by_owner[topology.owner_of(key).port].append(key)
            number += 1
        with topology.client() as client:
            for keys in keys_by_owner.values():
                for key in keys:
                    client.set(key, key.upper())
            for keys in keys_by_owner.values():
                for key in keys:
                    assert client.get(key) == key.upper()
        for master in masters:  # each master really holds its own share
            assert int(master.command("DBSIZE")) == len(keys_by_owner[master.port])  # type: ignore[call-overload]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cluster_replica_takes_over_a_killed_master(tmp_path: Path) -> None:
    with servers.cluster(tmp_path, masters=3, replicas_per_master=1) as topology:
        assert len(topology.nodes) == 6
        victim = topology.masters()[0]
        (replica,) = topology.replicas_of(victim)
        key = next(f"key:{n}" for n in range(1000) if topology.owner_of(f"key:{n}") is victim)
        with topology.client() as client:
            client.set(key, "before")
            assert int(victim.command("WAIT", 1, 5000)) == 1  # type: ignore[call-overload]
            victim.kill()
            promoted = topology.wait_for_promotion(victim)
            assert promoted is replica
            assert topology.owner_of(key) is replica
            assert client.get(key) == "before"
            client.set(key, "after")
            assert replica.command("GET", key) == "after"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sentinel_reports_the_master_and_fails_over_when_it_dies(tmp_path: Path) -> None:
    with servers.sentinel(tmp_path, replicas=1, sentinels=3) as group:
        ports = ",".join(f"127.0.0.1:{node.port}" for node in group.sentinels)
        assert group.url == f"redis+sentinel://{ports}/mymaster"
        old = group.master
        (replica,) = group.replicas
        assert replica.info("replication")["master_link_status"] == "up"
        sentinel = group.client()
        master = sentinel.master_for("mymaster")
        try:
            assert sentinel.discover_master("mymaster") == old.address
            master.set("written", "before")
            assert master.wait(1, 5000) == 1
            started = time.monotonic()
            new = group.failover("kill")
            took = time.monotonic() - started
            assert new is replica
            assert not old.alive
            assert sentinel.discover_master("mymaster") == replica.address
            assert master.get("written") == "before"  # the client follows the sentinels
            assert took < servers.PATIENCE
        finally:
            master.close()
            for connection in sentinel.sentinels:
                connection.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sentinel_failover_command_demotes_the_old_master(tmp_path: Path) -> None:
    with servers.sentinel(tmp_path, replicas=1, sentinels=3, appendonly=False) as group:
        old = group.master
        new = group.failover("command")
        assert new is not old
        assert old.alive
        servers._poll(group.replicas_synced, "the old master replicates from the new one")
        assert old.info("replication")["role"] == "slave"


def test_session_fixture_gives_a_working_standalone(redis_url: str, redis_server) -> None:  # type: ignore[no-untyped-def]
    with redis.Redis.from_url(redis_url) as client:
        assert client.ping() is True
    assert redis_server.info("persistence")["aof_enabled"] == "0"


@pytest.mark.slow
def test_session_fixtures_give_a_working_cluster_and_sentinel_group(
    redis_cluster_url: str,
    redis_sentinel_url: str,
    redis_cluster,
    redis_sentinel,  # type: ignore[no-untyped-def]
) -> None:
    assert redis_cluster_url == redis_cluster.url
    assert redis_cluster_url.startswith("redis+cluster://127.0.0.1:")
    with redis_cluster.client() as client:
        client.set("{fixture}:a", "1")
        assert client.get("{fixture}:a") == "1"
    assert redis_sentinel_url == redis_sentinel.url
    assert redis_sentinel_url.endswith("/mymaster")
    sentinel = redis_sentinel.client()
    master = sentinel.master_for("mymaster")
    try:
        assert master.ping() is True
    finally:
        master.close()
        for connection in sentinel.sentinels:
            connection.close()
