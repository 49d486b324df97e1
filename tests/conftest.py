"""Fixtures for every test directory: real servers (Redis, PostgreSQL, memcached,
ZooKeeper, etcd), started on first use and stopped at the end of the session (see the
plugin modules)."""

pytest_plugins = [
    "_etcd_fixtures",
    "_memcached_fixtures",
    "_pg_fixtures",
    "_redis_fixtures",
    "_zk_fixtures",
]
