"""``--json-logs`` covers every process of a mesh: serve's own lines and its self-worker's."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys

from conftest import FAST


def test_serve_and_its_self_worker_log_one_json_object_per_line(tmp_path):
    token = secrets.token_urlsafe(32)
    env = {**os.environ, **FAST, "GPUMESH_HOME": str(tmp_path), "GPUMESH_TOKEN": token}
    serve = subprocess.Popen([sys.executable, "-m", "gpumesh", "--json-logs", "serve", "--port",
                              "0", "--slots", "1", "--no-save"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    records = []
    try:
        assert serve.stderr is not None
        for line in serve.stderr:
            records.append(json.loads(line))  # every line is one JSON object
            messages = [r["message"] for r in records]
            if any(m.startswith("[worker] joined mesh as") for m in messages) and \
                    any(m.startswith("[mesh] worker joined:") for m in messages):
                break
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        rest = serve.communicate(timeout=20)[1]
    records += [json.loads(line) for line in rest.splitlines() if line.strip()]
    messages = [r["message"] for r in records]
    assert any(m.startswith("[mesh] worker left:") for m in messages)  # serve's own line
    assert {r["logger"] for r in records} >= {"gpumesh.events"}
    assert all(token not in json.dumps(r) for r in records)
