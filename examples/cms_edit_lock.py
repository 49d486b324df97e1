"""Story 5: edit locks in a CMS admin, kept alive by the browser — on memcached.

The server side of an edit page, as four request handlers. Nothing is kept in memory
between requests: the browser holds its edit session's token, and every handler works
from the document id and that token alone (``Locks.renew`` / ``Locks.release`` are
stateless). Each open window is its own edit session, so the same user with two
windows is two holders.

- ``open_edit(doc_id, editor)``: take the document's lock, or say who holds it and
  since when ("locked by Alice (alice@example.com) since 10:04:31"); ``force=True``
  takes it over.
- ``heartbeat(doc_id, token)``: the page calls it every few seconds to keep the lock;
  a displaced window learns that its lock is lost, and to whom.
- ``save(doc_id, token, text)``: writes only while the token holds the lock, and the
  document store also rejects a write whose fence is older than the last one it took.
- ``close(doc_id, token)``: the page is closed; a crashed browser's lock expires on
  its own after ``EDIT_TTL`` seconds without heartbeats.

memcached is a cache (see ``keymutex.stores.memcached``): a restart or an eviction
forgets edit locks, which for edit locks means at worst two editors at once — the
fence check at save time still refuses the older window's writes.

Run it to watch two editors::

    python examples/cms_edit_lock.py [MEMCACHED_URL] [--record FILE]

(default URL: ``$KEYMUTEX_STORE`` or ``memcached://127.0.0.1:11211``, which needs
``pip install 'keymutex[memcached]'``; any other store URL works too, e.g.
``sqlite:///tmp/cms.db`` or a lock server's ``http://127.0.0.1:7420``). ``--record``
writes each request and its answer as JSON lines (tokens left out) to FILE, replacing
what it held; without it, the record is kept, as the documents are, in a temporary
directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import keymutex

EDIT_TTL = 1.5  # seconds an edit lock lives without a heartbeat (a real CMS: 30 to 60)
HEARTBEAT_EVERY = EDIT_TTL / 3
# Seconds past EDIT_TTL that a store may keep a crashed window's lock: etcd's leases last
# whole seconds, and it can free a vanished holder's key 1-2.5 s after its TTL.
EXPIRY_GRACE = 5.0


def _clock(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(seconds))


def _who(holder: keymutex.Holder | None) -> dict[str, Any] | None:
    if holder is None:
        return None
    info = holder.info or {}
    return {
        "name": info.get("name"),
        "email": info.get("email"),
        "since": holder.acquired_at,
        "until": holder.expires_at,
        "fence": holder.fence,
    }


class Documents:
    """The CMS's document store: one JSON file per document, fenced.

    A write carries the fence of the edit lock it was made under; a write with a
    fence older than the last accepted one is rejected, so a window that lost its
    lock (taken over, expired, or forgotten by memcached) cannot overwrite newer text.
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, doc_id: str) -> Path:
        # Percent-encoded ("/" too): a document id from a request ("../../etc/x")
        # must not name a file outside the directory.
        return self._directory / f"{quote(doc_id, safe='')}.json"

    def read(self, doc_id: str) -> dict[str, Any]:
        path = self._path(doc_id)
        if not path.exists():
            return {"text": "", "fence": 0, "by": None}
        document: dict[str, Any] = json.loads(path.read_text())
        return document

    def write(self, doc_id: str, text: str, fence: int, by: str) -> bool:
        if fence < self.read(doc_id)["fence"]:
            return False
        self._path(doc_id).write_text(json.dumps({"text": text, "fence": fence, "by": by}))
        return True


class EditDesk:
    """The edit-lock handlers of one CMS server process (create it once at startup)."""

    def __init__(self, url: str, documents: Documents, namespace: str = "cms-edit") -> None:
        self.locks = keymutex.Locks(url, namespace=namespace, ttl=EDIT_TTL)
        self.documents = documents

    def open_edit(
        self, doc_id: str, editor: dict[str, str], force: bool = False
    ) -> dict[str, Any]:
        """GET /edit/<doc_id>: the lock for this window, or who holds it."""
        try:
            lease = self.locks.acquire(doc_id, timeout=0, info=editor, steal=force)
        except keymutex.Locked as exc:
            who = _who(exc.holder)
            message = "locked"
            if who is not None:
                message = f"locked by {who['name']} ({who['email']}) since {_clock(who['since'])}"
            return {"status": "locked", "by": who, "message": message}
        return {
            "status": "editing",
            "token": lease.token,
            "fence": lease.fence,
            "expires_at": lease.expires_at,
            "heartbeat_every": HEARTBEAT_EVERY,
            "text": self.documents.read(doc_id)["text"],
        }

    def heartbeat(self, doc_id: str, token: str) -> dict[str, Any]:
        """POST /edit/<doc_id>/heartbeat: keep the lock, or learn that it is gone."""
        try:
            lease = self.locks.renew(doc_id, token)
        except keymutex.LockLost as exc:
            return self._lost(exc)
        return {"status": "editing", "fence": lease.fence, "expires_at": lease.expires_at}

    def save(self, doc_id: str, token: str, text: str) -> dict[str, Any]:
        """POST /edit/<doc_id>/save: only under the lock, and only with a current fence."""
        try:
            lease = self.locks.renew(doc_id, token)  # proves the token holds the lock now
        except keymutex.LockLost as exc:
            return self._lost(exc)
        editor = (lease.info or {}).get("name", lease.owner)
        if not self.documents.write(doc_id, text, lease.fence, editor):
            return {"status": "stale", "message": "a newer edit was saved meanwhile"}
        return {"status": "saved", "fence": lease.fence}

    def close(self, doc_id: str, token: str) -> dict[str, Any]:
        """POST /edit/<doc_id>/close (the page's unload beacon): release the lock."""
        try:
            self.locks.release(doc_id, token)
        except keymutex.LockLost as exc:
            return self._lost(exc)
        return {"status": "closed"}

    @staticmethod
    def _lost(exc: keymutex.LockLost) -> dict[str, Any]:
        who = _who(exc.holder)
        message = "your edit lock is gone (expired or closed)"
        if who is not None:
            message = f"your edit lock was taken over by {who['name']} ({who['email']})"
        return {"status": "lost", "by": who, "message": message}

    def shutdown(self) -> None:
        self.locks.close()


ALICE = {"name": "Alice", "email": "alice@example.com"}
BOB = {"name": "Bob", "email": "bob@example.com"}


def play(url: str, record: Path | None) -> bool:
    """Two editors on one page, step by step; each request and answer is recorded (in
    ``record``, else in the temporary directory of the documents). False if the crashed
    browser's lock outlived its TTL by more than ``EXPIRY_GRACE``."""
    namespace = f"cms-demo-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="keymutex-cms-") as directory:
        record = record or Path(directory) / "cms-edit.jsonl"
        return _play(url, record, namespace, Documents(Path(directory) / "documents"))


def _play(url: str, record: Path, namespace: str, documents: Documents) -> bool:
    desk = EditDesk(url, documents, namespace)
    start = time.monotonic()
    doc = "page-42"

    def step(actor: str, action: str, answer: dict[str, Any], note: str = "") -> dict[str, Any]:
        entry = {
            "at": round(time.monotonic() - start, 3),
            "actor": actor,
            "action": action,
            "answer": {k: v for k, v in answer.items() if k != "token"},
            "note": note,
        }
        with record.open("a", encoding="utf-8") as file:
            file.write(json.dumps(entry) + "\n")
        shown = answer.get("message") or answer["status"]
        print(f"{entry['at']:6.2f}s  {actor:<14} {action:<10} -> {shown}")
        return answer

    with record.open("w", encoding="utf-8") as file:
        file.write(json.dumps({"namespace": namespace, "doc": doc, "ttl": EDIT_TTL}) + "\n")
    try:
        alice = step("alice", "open", desk.open_edit(doc, ALICE))
        # The page's timer: heartbeats keep the lock well past its TTL while she edits.
        editing_until = time.monotonic() + 2 * EDIT_TTL
        while time.monotonic() < editing_until:
            time.sleep(HEARTBEAT_EVERY)
            step("alice", "heartbeat", desk.heartbeat(doc, alice["token"]), "the page's timer")
        step("alice", "save", desk.save(doc, alice["token"], "Alice's first draft"))
        step("bob", "open", desk.open_edit(doc, BOB))
        step("alice-window2", "open", desk.open_edit(doc, ALICE), "same user, second window")
        bob = step("bob", "open", desk.open_edit(doc, BOB, force=True), "force")
        step("alice", "heartbeat", desk.heartbeat(doc, alice["token"]), "after takeover")
        step("alice", "save", desk.save(doc, alice["token"], "Alice's late text"))
        step("bob", "save", desk.save(doc, bob["token"], "Bob's rewrite"))
        # Had memcached forgotten the takeover (restart, eviction), Alice's save would have
        # reached the document store with her older fence: the store refuses it.
        accepted = documents.write(doc, "Alice's late text", alice["fence"], "Alice")
        step("alice", "late-write", {"status": "saved" if accepted else "refused"}, "old fence")
        step("bob", "close", desk.close(doc, bob["token"]))
        step("alice", "close", desk.close(doc, alice["token"]), "a stale close changes nothing")
        alice = step("alice", "open", desk.open_edit(doc, ALICE), "after Bob closed")
        # Alice's browser crashes: no more heartbeats, no close.
        step("bob", "open", desk.open_edit(doc, BOB), "while the crashed lock lives")
        time.sleep(EDIT_TTL)
        # The store frees the key at the TTL or a little later (see EXPIRY_GRACE): Bob's
        # page asks who holds the document until nobody does.
        deadline = time.monotonic() + EXPIRY_GRACE
        while desk.locks.holder(doc) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        bob = step("bob", "open", desk.open_edit(doc, BOB), "after the crashed lock expired")
        if bob["status"] == "editing":
            step("bob", "close", desk.close(doc, bob["token"]))
        else:
            print(f"the crashed lock was still held {EXPIRY_GRACE:.0f} s past its TTL")
        final = documents.read(doc)
        with record.open("a", encoding="utf-8") as file:
            file.write(json.dumps({"document": final}) + "\n")
        print(
            f"document {doc}: {final['text']!r} (saved by {final['by']}, fence {final['fence']})"
        )
        return bool(bob["status"] == "editing")
    finally:
        desk.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "url", nargs="?", default=os.environ.get("KEYMUTEX_STORE", "memcached://127.0.0.1:11211")
    )
    parser.add_argument("--record", help="JSON-lines file of every request and its answer")
    args = parser.parse_args()
    try:  # one line, not a traceback, if this store cannot be used here
        with keymutex.Locks(args.url) as probe:
            probe.holder("probe")
    except (ImportError, ValueError, keymutex.StoreError) as exc:
        parser.error(f"{str(exc).rstrip('.')}; give another store URL, e.g. sqlite:///tmp/cms.db")
    expired = play(args.url, Path(args.record) if args.record else None)
    if args.record:
        print(f"record: {args.record}")
    return 0 if expired else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print(
            "interrupted: the editors were stopped; an edit lock left held expires on its own",
            file=sys.stderr,
        )
        sys.exit(130)
