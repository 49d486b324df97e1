"""``python -m keymutex``: the ``keymutex`` command (see ``keymutex.cli``)."""

from keymutex.cli import main

if __name__ == "__main__":
    main()
