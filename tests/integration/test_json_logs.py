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
    # The usual heartbeat, not FAST's 0.2 s: the self-worker says goodbye (and serve logs
    # "worker left") only while its session is up, and under FAST a one-second stall of a busy
    # 2-core machine ends the session; it failed that way once in a full run.
    env = {**os.environ, **FAST, "GPUMESH_HEARTBEAT": "1.0", "GPUMESH_HOME": str(tmp_path),
           "GPUMESH_TOKEN": token}
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
