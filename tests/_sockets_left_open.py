"""A pytest plugin that names the test that left a socket open (not loaded by default).

Warnings are errors in this suite, so a socket that one test leaves open fails
whichever later test the garbage collector happens to find it in: a flake far from its
cause. With this plugin, each socket remembers the test and the stack that made it; the
collector runs after every test, and each finalizer warning is written, with its maker,
to ``$SOCKETS_LEFT_OPEN_LOG`` (default ``sockets-left-open.log``). A whole run is
about half as slow again::

    PYTHONPATH=tests .venv/bin/python -m pytest -n 4 -p _sockets_left_open
    CI=true PYTHONPATH=$PWD/tests PYTEST_ADDOPTS="-p _sockets_left_open" bash .ci/run

Found with it: a memcached renewal ending after its store closed, and the Redis
connections of an event loop that ``asyncio.run`` had ended.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
import warnings
from collections.abc import Callable, Generator
from typing import Any

import pytest

LOG = os.environ.get("SOCKETS_LEFT_OPEN_LOG", "sockets-left-open.log")
_made: dict[int, tuple[str, str]] = {}  # id of an open socket: the test, the stack
_current = ["(no test yet)"]
_init = socket.socket.__init__
_real_close = socket.socket._real_close  # type: ignore[attr-defined]
_detach = socket.socket.detach


def _recorded_init(self: socket.socket, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    _made[id(self)] = (_current[0], "".join(traceback.format_stack(limit=18)[:-1]))


def _recorded_close(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
    _made.pop(id(self), None)
    return _real_close(self, *args, **kwargs)


def _recorded_detach(self: socket.socket) -> int:
    _made.pop(id(self), None)
    return _detach(self)


socket.socket.__init__ = _recorded_init  # type: ignore[method-assign]
socket.socket._real_close = _recorded_close  # type: ignore[attr-defined]
socket.socket.detach = _recorded_detach  # type: ignore[method-assign]


def _naming(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    def hook(unraisable: Any) -> None:
        where = _made.get(id(unraisable.object))
        with open(LOG, "a") as log:
            log.write(f"=== pid {os.getpid()} during {_current[0]}: {unraisable.exc_value!r}\n")
            log.write(f"object: {unraisable.object!r}\n")
            if where is None:
                log.write("made: not recorded (not a socket, or made before the plugin)\n")
            else:
                log.write(f"made during {where[0]}\n{where[1]}\n")
        previous(unraisable)

    return hook


def _phase(item: pytest.Item, phase: str) -> Generator[None, None, None]:
    _current[0] = f"{item.nodeid} {phase}"
    previous = sys.unraisablehook
    sys.unraisablehook = _naming(previous)
    try:
        yield
        if phase == "teardown":  # what the test left behind: found now, named now
            _current[0] = f"{item.nodeid} (collected after its teardown)"
            with warnings.catch_warnings():
                warnings.simplefilter("error", ResourceWarning)
                gc.collect()
    finally:
        sys.unraisablehook = previous


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    yield from _phase(item, "setup")


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    yield from _phase(item, "call")


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    yield from _phase(item, "teardown")
