"""Fixtures for every test directory: real Redis servers (see tests/_redis_fixtures.py)."""

pytest_plugins = ["_redis_fixtures"]
