"""The live dashboard: a web page of the mesh, served from the standard library.

A layer above ``client/`` (it watches the mesh as one authenticated client) and below ``cli/``
(``gpumesh dashboard``, ``gpumesh serve --dashboard``); it imports nothing of the coordinator or
the worker. ``monitor.py`` polls, ``guard.py`` decides who may look and act, ``server.py``
serves; the page itself is ``static/``.
"""

from .server import DEFAULT_PORT, Dashboard

__all__ = ["DEFAULT_PORT", "Dashboard"]
