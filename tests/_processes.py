"""What every helper that starts a real server for the tests needs: a free port that no
other helper of this process was given, and a way to die with the test run."""

from __future__ import annotations

import shutil
import socket
import threading

HOST = "127.0.0.1"

_ports_lock = threading.Lock()
_ports_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on now, never the same one twice in this process."""
    with _ports_lock:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((HOST, 0))
                port = int(sock.getsockname()[1])
            if port not in _ports_handed_out:
                _ports_handed_out.add(port)
                return port


def parent_death_guard() -> list[str]:
    """A command prefix that kills the server if the test run dies (``setpriv``).

    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, so it is only
    used for servers started by the main thread (which lives as long as the process).
    """
    if threading.current_thread() is threading.main_thread() and shutil.which("setpriv"):
        return ["setpriv", "--pdeathsig", "KILL", "--"]
    return []
