"""A pytest plugin that runs joblib's own ``test_parallel.py`` against the ``"gpumesh"`` backend.

``python -m pytest -p joblib_mesh_plugin --pyargs joblib.test.test_parallel -k gpumesh``: joblib
builds its backend lists when the module is imported, so the backend must be registered before
collection (importing gpumesh does it when joblib is imported), and a live mesh must be there for
the whole session (started here, on loopback, and stopped at the end).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import Mesh  # noqa: E402

import gpumesh  # noqa: E402,F401  (registers "gpumesh" with joblib when joblib is imported)

_mesh: Mesh | None = None
# loky's children never import gpumesh, so a nested Parallel there cannot name the backend.
NOT_APPLICABLE = {"test_nested_loop[loky-gpumesh]", "test_nested_loop[back_compat_backend-gpumesh]"}


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    keep = [item for item in items if item.name not in NOT_APPLICABLE]
    config.hook.pytest_deselected(items=[item for item in items if item.name in NOT_APPLICABLE])
    items[:] = keep


def pytest_configure(config):  # type: ignore[no-untyped-def]
    global _mesh
    if _mesh is not None:
        return
    _mesh = Mesh(Path(tempfile.mkdtemp(prefix="gpumesh-joblib-")))
    _mesh.start_coordinator()
    _mesh.add_worker(slots=2)
    _mesh.add_worker(slots=2)
    _mesh.wait_workers(2)
    os.environ.update(_mesh.env)
    os.environ["GPUMESH_URL"] = _mesh.coordinator.url
    os.environ["GPUMESH_TOKEN"] = _mesh.token


def pytest_unconfigure(config):  # type: ignore[no-untyped-def]
    global _mesh
    if _mesh is not None:
        _mesh.close()
        _mesh = None
