"""`serve`'s self-worker: restarted when it exits, but not twice a second forever when it fails
at its start (as it did on Windows, where a worker cannot run)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from conftest import FAST, poll_until

# Loaded by every Python process started with this folder on PYTHONPATH: a `gpumesh join`
# (the self-worker) exits at once, as one that cannot start would; `serve` runs as usual.
_FAILING_JOIN = """
import sys
if "join" in sys.argv:
    sys.stderr.write("[test] this worker cannot start here\\n")
    raise SystemExit(3)
"""


def test_a_self_worker_that_keeps_failing_at_start_is_given_up_with_a_reason(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FAILING_JOIN)
    token_file = tmp_path / "mesh.token"
    subprocess.run([sys.executable, "-m", "gpumesh", "token", "--file", str(token_file)],
                   check=True, capture_output=True, env={**os.environ, "GPUMESH_HOME": str(tmp_path)})
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(tmp_path / "home"), "PYTHONPATH": str(site),
           "GPUMESH_DISCOVERY": "0"}
    lines: list[str] = []
    with subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", "0", "--no-save",
                           "--db", ":memory:", "--token-file", str(token_file)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as serve:
        assert serve.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(serve.stdout), daemon=True)
        reader.start()
        try:
            given_up = poll_until(lambda: any("not restarted again" in line for line in lines), 60)
            assert given_up, "".join(lines)
            assert sum("restarting it" in line for line in lines) == 2
            assert serve.poll() is None  # the coordinator keeps running without it
        finally:
            serve.terminate()
            serve.wait(15)
            reader.join(5)
    said = "".join(lines)
    assert "3 times in a row" in said and "gpumesh join tcp://127.0.0.1:" in said
