"""The protected resource: a tiny TCP server that keeps the largest fence per key.

Protocol: one JSON object per line, each answered by one line.

- ``{"op": "write", "key": k, "fence": f, "value": v, "client": c}`` ->
  ``{"accepted": bool, "last": n}``. With fencing on, the write is accepted only if
  ``f`` is larger than every fence accepted before for ``k`` (``last``, the largest so
  far, or ``null``); with fencing off (``--no-fencing``) every write is accepted.
- ``{"op": "ping"}`` -> ``{"pong": true}``.

Every write is logged, accepted or not, as a JSON line ``{"t": monotonic, "key",
"fence", "value", "client", "accepted", "last"}``. The log is the resource's own
record of what it let through: the fencing checker reads it.

Run as ``python -m safety._tools.resource --log FILE [--no-fencing]``; it binds a free
port of 127.0.0.1 and prints ``PORT <n>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

__all__ = ["ResourceClient", "ResourceServer", "read_log"]

HOST = "127.0.0.1"


class _Resource:
    def __init__(self, log: IO[str], fencing: bool) -> None:
        self._log = log
        self._fencing = fencing
        self._last: dict[str, int] = {}

    def write(self, request: dict[str, Any]) -> dict[str, Any]:
        key, fence = str(request["key"]), int(request["fence"])
        last = self._last.get(key)
        accepted = not self._fencing or last is None or fence > last
        if accepted:
            self._last[key] = fence if last is None else max(last, fence)
        entry = {
            "t": time.monotonic(),
            "key": key,
            "fence": fence,
            "value": request.get("value"),
            "client": request.get("client"),
            "accepted": accepted,
            "last": last,
        }
        self._log.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self._log.flush()
        return {"accepted": accepted, "last": last}

    async def serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while line := await reader.readline():
                request = json.loads(line)
                # write() has no await inside: each request is atomic.
                reply = self.write(request) if request.get("op") == "write" else {"pong": True}
                writer.write((json.dumps(reply) + "\n").encode())
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


async def _serve(log_path: str, fencing: bool) -> None:
    # Opened once at start, before serving; each entry is then written and flushed
    # in the loop on purpose: the log must be on disk before the reply is sent.
    with open(log_path, "a", encoding="utf-8") as log:  # noqa: ASYNC230
        resource = _Resource(log, fencing)
        server = await asyncio.start_server(resource.serve_client, HOST, 0)
        port = server.sockets[0].getsockname()[1]
        print(f"PORT {port}", flush=True)
        async with server:
            await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log", required=True)
    parser.add_argument("--no-fencing", dest="fencing", action="store_false")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.log, args.fencing))


class ResourceServer:
    """The resource as a child process of the tests (a context manager)."""

    def __init__(self, log: Path, *, fencing: bool = True) -> None:
        self.log = log
        self.fencing = fencing
        self.process: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> Self:
        command = [sys.executable, "-m", "safety._tools.resource", "--log", str(self.log)]
        if not self.fencing:
            command.append("--no-fencing")
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"the resource server did not start: {line!r}")
        self.port = int(line.split()[1])
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait()
            if self.process.stdout is not None:
                self.process.stdout.close()

    def entries(self) -> list[dict[str, Any]]:
        return read_log(self.log)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def read_log(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def child_env() -> dict[str, str]:
    """The environment of our child processes: ``tests/`` importable, as under pytest."""
    tests_dir = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH")) if p)
    return env


class ResourceClient:
    """A blocking client of the resource (one connection, one request at a time)."""

    def __init__(self, address: str, client: str) -> None:
        host, _, port = address.rpartition(":")
        self._sock = socket.create_connection((host, int(port)), timeout=30)
        self._file = self._sock.makefile("rw", encoding="utf-8", newline="\n")
        self._client = client

    def write(self, key: str, fence: int, value: object) -> tuple[bool, int | None]:
        """Ask the resource to take ``value``; whether it did, and its previous fence."""
        request = {"op": "write", "key": key, "fence": fence, "value": value}
        request["client"] = self._client
        self._file.write(json.dumps(request) + "\n")
        self._file.flush()
        reply = json.loads(self._file.readline())
        return bool(reply["accepted"]), reply["last"]

    def close(self) -> None:
        self._file.close()
        self._sock.close()


if __name__ == "__main__":
    main()
