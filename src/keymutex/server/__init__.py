"""The keymutex lock server: lease locks of any store over HTTP (docs/http-api.md).

Needs the ``server`` extra (``pip install 'keymutex[server]'``). ``keymutex serve``
runs it with uvicorn; ``create_app`` gives the ASGI app to any other server.
"""

from keymutex.server._app import create_app

__all__ = ["create_app"]
