"""CPython's own executor tests (``test.test_concurrent_futures``) against ``MeshExecutor`` on a
live mesh: the executor-agnostic classes, as the standard library runs them on its own pools.
(``FutureTests`` tests the standard library's own ``Future`` only, and needs pytest's logging
capture off: it is left out.)

Debian ships the file in ``libpython3.11-testsuite`` (``.ci/run`` installs it). The three shutdown
tests that import the executor class from ``concurrent.futures`` by name are rewritten below for
a third-party class; their assertions are CPython's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import unittest
from pathlib import Path

import pytest
from conftest import Mesh

TESTSUITE = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}/test")
if not (TESTSUITE / "test_concurrent_futures.py").is_file():
    reason = (f"CPython's test_concurrent_futures is not installed ({TESTSUITE}): "
              f"apt-get install -y libpython{sys.version_info.major}.{sys.version_info.minor}"
              "-testsuite")
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError(reason)
    pytest.skip(reason, allow_module_level=True)

import test  # noqa: E402

if str(TESTSUITE) not in test.__path__:
    test.__path__.append(str(TESTSUITE))

import cloudpickle  # noqa: E402
from test import test_concurrent_futures as cpython  # noqa: E402

from gpumesh.client.executor import MeshExecutor  # noqa: E402

# Workers cannot import the test module (it lives outside their Python's test package): its
# functions and classes travel by value instead, as a notebook's would.
cloudpickle.register_pickle_by_value(cpython)


class LiveMeshExecutor(MeshExecutor):
    """``executor_type(max_workers=N)`` as the tests build it, on the mesh of this module."""

    url = ""
    token = ""

    def __init__(self, max_workers: int | None = None) -> None:
        super().__init__(self.url, self.token, max_workers=max_workers)


@pytest.fixture(scope="module", autouse=True)
def live_mesh(tmp_path_factory):
    env = Mesh(tmp_path_factory.mktemp("cpython-executor"))
    try:
        env.start_coordinator()
        env.add_worker(slots=3)
        env.add_worker(slots=3)
        env.wait_workers(2)
        saved = {key: os.environ.get(key) for key in env.env}
        os.environ.update(env.env)  # the executors' GPUMesh reads the fast timings from here
        LiveMeshExecutor.url, LiveMeshExecutor.token = env.coordinator.url, env.token
        yield env
    finally:
        for key, value in locals().get("saved", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        env.close()


class MeshMixin(cpython.ExecutorMixin):
    executor_type = LiveMeshExecutor


class MeshExecutorTest(MeshMixin, cpython.ExecutorTest, cpython.BaseTestCase):
    pass


class MeshWaitTests(MeshMixin, cpython.WaitTests, cpython.BaseTestCase):
    pass


class MeshAsCompletedTests(MeshMixin, cpython.AsCompletedTests, cpython.BaseTestCase):
    pass


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter with the mesh in its environment (the token never on a command line)."""
    env = {**os.environ, "GPUMESH_URL": LiveMeshExecutor.url,
           "GPUMESH_TOKEN": LiveMeshExecutor.token,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    prologue = textwrap.dedent(f"""
        import test, cloudpickle
        test.__path__.append({str(TESTSUITE)!r})
        from test import test_concurrent_futures
        cloudpickle.register_pickle_by_value(test_concurrent_futures)
        from test.test_concurrent_futures import sleep_and_print
        from gpumesh import MeshExecutor
        """)
    return subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=60)


class MeshShutdownTest(MeshMixin, cpython.ExecutorShutdownTest, cpython.BaseTestCase):
    # CPython's versions run "from concurrent.futures import <executor>"; these are the same
    # programs with this executor, and CPython's assertions on their output. Remote prints come
    # back prefixed with the worker, so "apple" is looked for at the end of the output.

    def test_interpreter_shutdown(self):
        done = _python("""
            t = MeshExecutor()
            t.submit(sleep_and_print, 1.0, "apple")
            """)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertNotIn("Traceback", done.stderr)
        self.assertTrue(done.stdout.strip().endswith("apple"), repr(done.stdout))

    def test_submit_after_interpreter_shutdown(self):
        done = _python("""
            import atexit
            @atexit.register
            def run_last():
                try:
                    t.submit(id, None)
                except RuntimeError:
                    print("runtime-error")
                    raise
            t = MeshExecutor()
            t.submit(id, 42).result()
            """)
        self.assertIn("RuntimeError: cannot schedule new futures", done.stderr)
        self.assertEqual(done.stdout.strip(), "runtime-error")

    def test_hang_gh83386(self):
        done = _python("""
            t = MeshExecutor()
            t.submit(sleep_and_print, 1.0, "apple")
            t.shutdown(wait=False)
            """)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertNotIn("Traceback", done.stderr)
        self.assertTrue(done.stdout.strip().endswith("apple"), repr(done.stdout))


def test_the_cpython_classes_are_collected():
    # A renamed class upstream would silently run nothing: name what must be there.
    for name in ("ExecutorTest", "WaitTests", "AsCompletedTests", "ExecutorShutdownTest",
                 "ExecutorMixin", "BaseTestCase"):
        assert isinstance(getattr(cpython, name), type), name
    assert issubclass(MeshExecutorTest, unittest.TestCase)
