"""The JavaScript client as npm would pack it (clients/js/package.json)."""

from __future__ import annotations

import json
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "js"


def test_every_file_the_package_lists_is_a_regular_file() -> None:
    # npm pack leaves symbolic links out of the tarball without a word: a linked
    # keymutex.js would publish a package with types and no code.
    manifest = json.loads((CLIENT / "package.json").read_text())
    listed = set(manifest["files"])
    entry = manifest["exports"]["."]
    assert {manifest["main"].removeprefix("./"), entry["default"].removeprefix("./")} <= listed
    assert {manifest["types"].removeprefix("./"), entry["types"].removeprefix("./")} <= listed
    for name in sorted(listed):
        path = CLIENT / name
        assert not path.is_symlink(), f"{path} must be the file itself, not a link"
        assert path.is_file(), f"{path} is missing"
