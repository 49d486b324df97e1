"""Story 5 on memcached and on etcd: ``examples/cms_edit_lock.py`` does what it says.

The example runs against the session's real memcached (its default store) and etcd,
and records every request and its answer; each claim is checked from that record (and
from the store itself afterwards), not from the example's printed verdicts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import keymutex

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cms_edit_lock.py"


def run(url: str, record: Path) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), url, "--record", str(record)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    return result.stdout, lines[0], lines[1:]


# On etcd, found by review: a crashed holder's key outlives its TTL by 1-2.5 s (leases
# of whole seconds), and the example, which waited exactly the TTL, crashed on Bob's
# refused open (KeyError: 'token').
@pytest.mark.parametrize("store", ["memcached_url", "etcd_url"])
def test_two_editors_take_over_and_the_displaced_window_finds_out(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue(store)
    record = tmp_path / "cms.jsonl"
    record.write_text('{"from": "an earlier run"}\n')  # replaced, not appended to
    output, setup, entries = run(url, record)
    assert f"record: {record}" in output
    *steps, final = entries
    document = final["document"]
    assert all("token" not in json.dumps(s["answer"]) for s in steps)  # secrets stay out

    def answers(actor: str, action: str) -> list[dict[str, Any]]:
        return [s["answer"] for s in steps if s["actor"] == actor and s["action"] == action]

    alice_open, alice_reopen = answers("alice", "open")
    *heartbeats_ok, heartbeat_lost = answers("alice", "heartbeat")
    bob_refused, bob_forced, bob_refused_by_crash, bob_after_expiry = answers("bob", "open")
    assert alice_open["status"] == "editing"

    # The page's heartbeats kept Alice's lock (the same lease, by its fence) for twice
    # its TTL: Bob, who came after, is refused by it.
    assert len(heartbeats_ok) >= 2
    assert all(h["status"] == "editing" for h in heartbeats_ok)
    assert all(h["fence"] == alice_open["fence"] for h in heartbeats_ok)
    opened = next(s for s in steps if s["answer"] is alice_open)
    refused_at = next(s for s in steps if s["answer"] is bob_refused)["at"]
    assert refused_at - opened["at"] >= 2 * setup["ttl"]

    # A second editor, and the same user in a second window, both see who holds it.
    for refused in (bob_refused, answers("alice-window2", "open")[0]):
        assert refused["status"] == "locked"
        assert refused["by"]["name"] == "Alice"
        assert refused["by"]["email"] == "alice@example.com"
        assert refused["by"]["fence"] == alice_open["fence"]
        assert abs(refused["by"]["until"] - heartbeats_ok[-1]["expires_at"]) < setup["ttl"]
        assert refused["message"].startswith("locked by Alice (alice@example.com) since ")
    assert "locked by Alice (alice@example.com) since" in output

    # The forced takeover: a larger fence; Alice's next heartbeat and save learn it.
    assert bob_forced["status"] == "editing"
    assert bob_forced["fence"] > alice_open["fence"]
    assert heartbeat_lost["status"] == "lost"
    assert heartbeat_lost["by"]["name"] == "Bob"
    assert heartbeat_lost["by"]["fence"] == bob_forced["fence"]
    first_save, late_save = answers("alice", "save")
    assert first_save["status"] == "saved"
    assert late_save["status"] == "lost"
    assert answers("alice", "late-write") == [{"status": "refused"}]

    # Only Bob's text survives, under Bob's fence.
    assert answers("bob", "save") == [{"status": "saved", "fence": bob_forced["fence"]}]
    assert document == {"text": "Bob's rewrite", "fence": bob_forced["fence"], "by": "Bob"}

    # Closing releases (a stale close changes nothing); a crashed browser's lock expires.
    assert answers("bob", "close") == [{"status": "closed"}, {"status": "closed"}]
    assert answers("alice", "close")[0]["status"] == "lost"
    assert alice_reopen["status"] == "editing"
    assert alice_reopen["fence"] > bob_forced["fence"]
    assert bob_refused_by_crash["status"] == "locked"
    assert bob_refused_by_crash["by"]["fence"] == alice_reopen["fence"]
    assert bob_after_expiry["status"] == "editing"
    assert bob_after_expiry["fence"] > alice_reopen["fence"]
    crashed = next(s for s in steps if s["answer"] is bob_refused_by_crash)
    expired = next(s for s in steps if s["answer"] is bob_after_expiry)
    assert expired["at"] - crashed["at"] >= setup["ttl"]

    # Nothing is left held in the store.
    with keymutex.Locks(url, namespace=setup["namespace"]) as locks:
        assert locks.holder(setup["doc"]) is None
        assert locks.holders() == []


def test_without_record_nothing_is_left_in_the_temporary_directory(
    memcached_url: str, tmp_path: Path
) -> None:
    """Found by review: without ``--record``, each run left a directory in /tmp with its
    record, and printed its path."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), memcached_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "TMPDIR": str(temporary)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'document page-42: "Bob\'s rewrite"' in result.stdout
    assert "record:" not in result.stdout
    assert list(temporary.iterdir()) == []


def test_a_document_id_cannot_name_a_file_outside_the_documents_directory(
    tmp_path: Path,
) -> None:
    """Before: the example, made to be copied, wrote ``<directory>/<doc_id>.json``
    as given, and the id ``../../x`` from a request wrote outside its directory."""
    spec = importlib.util.spec_from_file_location("cms_edit_lock", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    directory = tmp_path / "a" / "docs"
    documents = example.Documents(directory)
    for doc_id in ("../../escaped", "..", "sub/page", "100%"):
        assert documents.write(doc_id, f"text of {doc_id}", fence=1, by="alice")
        assert documents.read(doc_id)["text"] == f"text of {doc_id}"
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert len(written) == 4
    assert all(path.parent == directory for path in written), written
