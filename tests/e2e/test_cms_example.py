"""Story 5 on memcached: ``examples/cms_edit_lock.py`` does what it says.

The example runs against the session's real memcached and records every request and
its answer; each claim is checked from that record (and from memcached itself
afterwards), not from the example's printed verdicts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import keymutex

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cms_edit_lock.py"


def run(memcached_url: str, record: Path) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), memcached_url, "--record", str(record)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    return result.stdout, lines[0], lines[1:]


def test_two_editors_take_over_and_the_displaced_window_finds_out(
    memcached_url: str, tmp_path: Path
) -> None:
    output, setup, entries = run(memcached_url, tmp_path / "cms.jsonl")
    *steps, final = entries
    document = final["document"]
    assert all("token" not in json.dumps(s["answer"]) for s in steps)  # secrets stay out

    def answers(actor: str, action: str) -> list[dict[str, Any]]:
        return [s["answer"] for s in steps if s["actor"] == actor and s["action"] == action]

    alice_open, alice_reopen = answers("alice", "open")
    bob_refused, bob_forced, bob_refused_by_crash, bob_after_expiry = answers("bob", "open")
    assert alice_open["status"] == "editing"

    # A second editor, and the same user in a second window, both see who holds it.
    for refused in (bob_refused, answers("alice-window2", "open")[0]):
        assert refused["status"] == "locked"
        assert refused["by"]["name"] == "Alice"
        assert refused["by"]["email"] == "alice@example.com"
        assert refused["by"]["fence"] == alice_open["fence"]
        assert abs(refused["by"]["until"] - alice_open["expires_at"]) < setup["ttl"]
        assert refused["message"].startswith("locked by Alice (alice@example.com) since ")
    assert "locked by Alice (alice@example.com) since" in output

    # The forced takeover: a larger fence; Alice's next heartbeat and save learn it.
    assert bob_forced["status"] == "editing"
    assert bob_forced["fence"] > alice_open["fence"]
    heartbeat_ok, heartbeat_lost = answers("alice", "heartbeat")
    assert heartbeat_ok["status"] == "editing"
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

    # Nothing is left held in memcached.
    with keymutex.Locks(memcached_url, namespace=setup["namespace"]) as locks:
        assert locks.holder(setup["doc"]) is None
        assert locks.holders() == []
