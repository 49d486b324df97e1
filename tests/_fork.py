"""Forking a child that runs one function, for the tests of what a store does in it."""

from __future__ import annotations

import ctypes
import os
import signal
import traceback
from collections.abc import Callable


def fork_running(child: Callable[[], int], *, hooks: bool = True) -> int:
    """Fork; the child runs ``child`` and exits with what it returns (1 if it raised,
    with the traceback on stderr; killed by SIGALRM if it hangs 10 s). The parent gets
    the child's pid.

    Without ``hooks``, by libc's fork() (the GIL kept: ``PyDLL``): no at-fork hook runs
    in the child, as in uWSGI's prefork workers by default, or after a C extension's
    fork().
    """
    pid = os.fork() if hooks else ctypes.PyDLL(None).fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
            signal.alarm(10)
            code = child()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid
