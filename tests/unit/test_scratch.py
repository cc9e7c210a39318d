"""gpumesh.worker.scratch: a runner's own folder, its scripts ended and the folder removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_for

from gpumesh.runner.execute import SCRIPT_FOLDER
from gpumesh.worker import scratch

LINUX_PROC = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@LINUX_PROC
def test_a_script_killed_before_its_group_was_named_is_found_by_its_folder(tmp_path):
    # The runner names a script's group just after starting it: a cancel in between left
    # the script (in a session of its own) running, holding its GPU.
    folder = scratch.make(0)
    assert folder is not None
    workdir = os.path.join(folder, SCRIPT_FOLDER + "x")
    os.mkdir(workdir)
    script = subprocess.Popen(
        [sys.executable, "-c", "import select; select.select([], [], [], 60)"],
        cwd=workdir, start_new_session=True)
    try:
        scratch.end(folder)
        wait_for(lambda: script.poll() is not None, timeout=10, what="the script killed")
        assert script.returncode == -signal.SIGKILL
        wait_for(lambda: not os.path.exists(folder), timeout=10, what="its folder removed")
    finally:
        script.kill()
        script.wait()


def test_the_folder_is_removed_off_the_agents_loop_and_waited_for_at_exit(monkeypatch):
    # rmtree ran in the agent's loop: a killed script's clone or dataset took seconds to
    # delete, past the coordinator's 5 s silence limit when a job's runners were cancelled.
    folder = scratch.make(0)
    assert folder is not None
    os.mkdir(os.path.join(folder, SCRIPT_FOLDER + "big"))  # a script's folder: maybe big
    release, removing = threading.Event(), threading.Event()
    real = scratch.shutil.rmtree

    def slow(path, ignore_errors=False):
        removing.set()
        release.wait(30)
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(scratch.shutil, "rmtree", slow)
    scratch.end(folder)  # returns while the removal waits
    assert removing.wait(10) and os.path.exists(folder)
    release.set()
    # The agent's exit waits for it: a daemon thread dies with the process, and every join
    # that stopped left its runners' folders behind in /tmp.
    scratch.wait(10)
    assert not os.path.exists(folder)
    empty = scratch.make(1)
    assert empty is not None
    scratch.end(empty)  # no script's folder in it: removed at once, nothing left to a thread
    assert not os.path.exists(empty)


def test_a_killed_agents_folders_are_swept_once_stale(tmp_path, monkeypatch):
    # An agent killed with kill -9 ended none of its runners' folders: they stayed in /tmp.
    monkeypatch.setattr(scratch.tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {"stale": f"{scratch.PREFIX}{dead.pid}-0-a", "fresh": f"{scratch.PREFIX}{dead.pid}-1-b",
             "alive": f"{scratch.PREFIX}1-0-c", "mine": f"{scratch.PREFIX}{os.getpid()}-0-d",
             "other": "gpumesh-something-else"}
    old = time.time() - scratch.STALE_AFTER - 60
    for key, name in names.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "left").write_text("x")
        if key != "fresh":
            os.utime(tmp_path / name, (old, old))
    scratch._sweep(time.time())
    left = {path.name for path in tmp_path.iterdir()}
    assert left == {names["fresh"], names["alive"], names["mine"], names["other"]}
