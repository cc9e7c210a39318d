"""Zero-config joining across fake hosts: network namespaces on one switch (TESTING.md).

Inside the namespaces discovery runs as it would for users: on each host's LAN address, with
nothing configured but the token. The root namespace never multicasts (conftest pins it to
loopback); the lab's guard route makes a stray packet fail here instead of leaving the machine.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import wait_for

sys.path.insert(0, str(Path(__file__).parent.parent / "faults"))  # the namespace lab
from faultlab import Lab, require_netns  # noqa: E402
from other_major import FAKE_MAJOR, FAKE_VERSION  # noqa: E402

from gpumesh import __version__  # noqa: E402
from gpumesh.protocol import MAJOR  # noqa: E402

OTHER_MAJOR = Path(__file__).parent / "other_major.py"


def _env(mesh_env, token: str) -> dict[str, str]:
    # Inside a namespace, browse and advertise on its LAN address (eth0), as a user's machine
    # would; a generous window for a loaded 2-core machine (it ends at the first answer).
    return {**os.environ, **mesh_env.env, "GPUMESH_TOKEN": token,
            "GPUMESH_DISCOVERY_INTERFACES": "", "GPUMESH_DISCOVERY_TIMEOUT": "10"}


def _gpumesh(lab: Lab, host: str, env: dict[str, str], *args: str, timeout: float = 60
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", lab.ns(host), sys.executable, "-m", "gpumesh",
                           *args], env=env, capture_output=True, text=True, timeout=timeout)


def _workers(lab: Lab, host: str, env: dict[str, str], url: str) -> list[dict[str, Any]]:
    done = _gpumesh(lab, host, env, "workers", "--url", url, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _alive(lab: Lab, host: str, env: dict[str, str], url: str) -> set[str]:
    return {w["id"] for w in _workers(lab, host, env, url) if w["alive"]}


def _serve(lab: Lab, host: str, env: dict[str, str], tmp_path, *extra: str,
           program: tuple[str, ...] = ("-m", "gpumesh")) -> int:
    db = tmp_path / f"{host}-{secrets.token_hex(3)}.db"
    _, port = lab.spawn(host, [*program, "serve", "--port", "0", "--no-save", "--db", str(db),
                               *extra], env, ready=True, wait=60)
    return int(port)


def _join(lab: Lab, host: str, env: dict[str, str], *extra: str, flags: tuple[str, ...] = (),
          **spawn: Any) -> tuple[subprocess.Popen[bytes], str]:
    """``gpumesh [FLAGS] join`` with no URL: the worker id once it joined."""
    return lab.spawn(host, ["-m", "gpumesh", *flags, "join", "--no-benchmark", "--no-save",
                            "--slots", "1", *extra], env, ready=True, wait=60, **spawn)


def _ids(lab: Lab, host: str, env: dict[str, str], url: str) -> set[str]:
    """Every worker the coordinator lists, alive or not."""
    return {w["id"] for w in _workers(lab, host, env, url)}


def _tries(said: str) -> int:
    """How many times a ``-v`` worker found its coordinator gone, said or logged."""
    return said.count("[worker] lost the coordinator") + said.count("still no coordinator at")


def _link_back(lab: Lab, host: str) -> None:
    """Bring a host's link up again, with the route that going down deleted (TESTING.md)."""
    lab.link(host, True)
    subnet = lab.address(host).rsplit(".", 1)[0] + ".0/24"
    lab.run(host, "ip", "route", "replace", subnet, "dev", "eth0", "proto", "kernel", "scope",
            "link", "src", lab.address(host)).check_returncode()


def test_three_hosts_join_by_token_alone_and_two_meshes_stay_apart(mesh_env, tmp_path):
    require_netns()
    lab = Lab(["a", "b", "c"])
    try:
        env = _env(mesh_env, mesh_env.token)
        other = _env(mesh_env, secrets.token_urlsafe(32))
        # Two meshes with different tokens live on one LAN before anyone joins: every join
        # below browses and sees both coordinators, and must pick its own by the token alone.
        port = _serve(lab, "a", env, tmp_path, "--host", "0.0.0.0", "--slots", "1")
        other_port = _serve(lab, "b", other, tmp_path, "--host", "0.0.0.0", "--no-self-worker")
        url_a, url_b = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{other_port}"
        _, worker_b = _join(lab, "b", env)
        _, stranger_a = _join(lab, "a", other)
        _, worker_c = _join(lab, "c", env)
        _, stranger_c = _join(lab, "c", other)
        wait_for(lambda: len(_alive(lab, "a", env, url_a)) == 3, timeout=30,
                 what="the self-worker on a and the workers of b and c")
        ours = _ids(lab, "a", env, url_a)
        assert len(ours) == 3 and {worker_b, worker_c} <= ours
        assert not ours & {stranger_a, stranger_c}, "a worker of the other mesh joined ours"
        assert _ids(lab, "b", other, url_b) == {stranger_a, stranger_c}
        assert _alive(lab, "b", other, url_b) == {stranger_a, stranger_c}

        # A .map from a runs on all three.
        script = tmp_path / "spread.py"
        script.write_text(
            "import time\n"
            "from gpumesh import GPUMesh\n"
            "def nap(i):\n"
            "    time.sleep(0.2)\n"
            "    return i\n"
            f"with GPUMesh({url_a!r}) as mesh:\n"
            "    print(sum(mesh.map(nap, range(30))))\n")
        done = subprocess.run(["ip", "netns", "exec", lab.ns("a"), sys.executable, str(script)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.split()[-1] == str(sum(range(30))), done.stderr
        workers = _workers(lab, "a", env, url_a)
        assert all(w["completed"] > 0 for w in workers if w["alive"]), workers

        # What a user reads: the table lists the three, each [alive].
        table = _gpumesh(lab, "a", env, "workers", "--url", url_a)
        assert table.returncode == 0, table.stderr
        rows = [line for line in table.stdout.splitlines() if "score=" in line]
        assert len(rows) == 3 and all(row.rstrip().endswith("[alive]") for row in rows), \
            table.stdout
        assert {w["id"][:8] for w in workers} == {row.split()[1] for row in rows}

        # discover on c sees both, and marks the one of its token.
        listed = json.loads(_gpumesh(lab, "c", other, "discover", "--json").stdout)
        marks = {entry["url"]: entry["mesh"] for entry in listed}
        assert marks == {f"tcp://{lab.address('a')}:{port}": "another mesh",
                         f"tcp://{lab.address('b')}:{other_port}": "this mesh"}
    finally:
        lab.close()


def test_a_loopback_coordinator_is_neither_advertised_nor_found(mesh_env, tmp_path):
    require_netns()
    lab = Lab(["a", "b"])
    try:
        env = _env(mesh_env, mesh_env.token)
        env["GPUMESH_DISCOVERY_TIMEOUT"] = "3"
        port = _serve(lab, "a", env, tmp_path, "--host", "127.0.0.1", "--no-self-worker")
        listed = json.loads(_gpumesh(lab, "b", env, "discover", "--json", "--timeout", "3").stdout)
        assert listed == []
        # Nor can b reach it by its address: it listens on a's loopback only.
        direct = _gpumesh(lab, "b", {**env, "GPUMESH_CONNECT_TIMEOUT": "2"}, "workers", "--url",
                          f"tcp://{lab.address('a')}:{port}")
        assert direct.returncode == 1 and "cannot reach a coordinator" in direct.stderr
        failed = _gpumesh(lab, "b", env, "join", "--no-benchmark", "--no-save")
        assert failed.returncode == 1
        assert "no coordinator of this mesh answered on the LAN" in failed.stderr
        assert "it saw no gpumesh coordinator at all" in failed.stderr
        assert mesh_env.token not in failed.stderr + failed.stdout
    finally:
        lab.close()


def test_a_discovered_worker_follows_its_coordinator_to_another_address(mesh_env, tmp_path):
    require_netns()
    lab = Lab(["a", "b", "c"])
    try:
        env = _env(mesh_env, mesh_env.token)
        _serve(lab, "a", env, tmp_path, "--host", "0.0.0.0", "--no-self-worker")
        worker, worker_id = _join(lab, "c", env)
        for proc in list(lab.procs):
            if proc is not worker and proc.poll() is None:
                os.killpg(proc.pid, 9)  # the coordinator on a is gone for good...
        port = _serve(lab, "b", env, tmp_path, "--host", "0.0.0.0", "--no-self-worker")
        # ... and one with the same token starts on b: the worker finds it by itself.
        wait_for(lambda: worker_id in _alive(lab, "b", env, f"tcp://127.0.0.1:{port}"),
                 timeout=60, what="the worker to find the coordinator at its new address")
        assert worker.poll() is None
    finally:
        lab.close()


def test_two_hosts_started_from_a_copied_home_folder_are_two_workers(mesh_env, tmp_path):
    require_netns()
    lab = Lab(["a", "b", "c"])
    try:
        env = _env(mesh_env, mesh_env.token)
        port = _serve(lab, "a", env, tmp_path, "--host", "0.0.0.0", "--no-self-worker")
        url_a = f"tcp://127.0.0.1:{port}"
        home_b = tmp_path / "home-b"
        _, worker_b = _join(lab, "b", {**env, "GPUMESH_HOME": str(home_b)})
        # The folder taken to another machine, worker id file and all (exo#748, #1599).
        home_c = tmp_path / "home-c"
        shutil.copytree(home_b, home_c)
        assert list(home_c.glob("workers/*.json")), "the copy holds b's worker id"
        _, worker_c = _join(lab, "c", {**env, "GPUMESH_HOME": str(home_c)})
        assert worker_c != worker_b
        wait_for(lambda: _alive(lab, "a", env, url_a) == {worker_b, worker_c}, timeout=30,
                 what="both workers alive, neither replacing the other")
    finally:
        lab.close()


def test_a_worker_of_another_protocol_major_is_told_at_join_what_to_install(mesh_env, tmp_path):
    require_netns()
    lab = Lab(["a", "c"])
    try:
        env = _env(mesh_env, mesh_env.token)
        # A coordinator of this mesh that advertises, and answers, another protocol major.
        port = _serve(lab, "a", env, tmp_path, "--host", "0.0.0.0", "--no-self-worker",
                      program=(str(OTHER_MAJOR),))
        failed = _gpumesh(lab, "c", env, "join", "--no-benchmark", "--no-save")
        output = failed.stdout + failed.stderr
        assert failed.returncode == 1, output
        assert f"runs gpumesh {FAKE_VERSION} (protocol {FAKE_MAJOR}); this is gpumesh " \
               f"{__version__} (protocol {MAJOR}): install gpumesh {FAKE_VERSION} here " \
               f"('pip install gpumesh=={FAKE_VERSION}')" in failed.stderr, output
        assert "joined mesh as" not in output
        assert mesh_env.token not in output
        # Dialled by its URL it refuses too, in its own major: the fake is more than a TXT.
        direct = _gpumesh(lab, "c", env, "join", f"tcp://{lab.address('a')}:{port}",
                          "--no-benchmark", "--no-save")
        assert direct.returncode == 1, direct.stdout + direct.stderr
        # Its refusal names its version, so the advice is the same as by discovery.
        assert f"runs gpumesh {FAKE_VERSION} (protocol {FAKE_MAJOR}) and this gpumesh " \
               f"({__version__}) speaks {MAJOR}: install gpumesh {FAKE_VERSION} here" \
               in direct.stderr, direct.stderr
        assert mesh_env.token not in direct.stdout + direct.stderr
    finally:
        lab.close()


def test_a_worker_whose_link_drops_comes_back_as_itself_and_says_so_once(mesh_env, tmp_path):
    require_netns()
    lab = Lab(["a", "b"])
    try:
        env = {**_env(mesh_env, mesh_env.token), "PYTHONUNBUFFERED": "1"}
        port = _serve(lab, "a", env, tmp_path, "--host", "0.0.0.0", "--no-self-worker")
        url_a = f"tcp://127.0.0.1:{port}"
        said = tmp_path / "worker-b.out"
        with said.open("wb") as sink:  # -v: its retries are logged (DEBUG), one line each
            worker, worker_id = _join(lab, "b", env, flags=("-v",), stdout=sink,
                                      stderr=subprocess.STDOUT)
        wait_for(lambda: worker_id in _alive(lab, "a", env, url_a), timeout=30,
                 what="the worker of b, found by discovery")

        lab.link("b", False)  # Wi-Fi gone
        # Down for three failed tries (the first is said, the others only logged), so that
        # "said once" is about several of them.
        wait_for(lambda: _tries(said.read_text()) >= 3
                 and worker_id not in _alive(lab, "a", env, url_a), timeout=60,
                 what="b to fail three tries in the outage, and a to list its worker as lost")
        _link_back(lab, "b")
        wait_for(lambda: worker_id in _alive(lab, "a", env, url_a), timeout=60,
                 what="the same worker alive again")
        wait_for(lambda: "[worker] back:" in said.read_text(), timeout=30,
                 what="b to say it is back")

        assert worker.poll() is None, "the worker process restarted or exited"
        text = said.read_text()
        endpoint = re.escape(f"tcp://{lab.address('a')}:{port}")
        assert len(re.findall(rf"\[worker\] lost the coordinator at {endpoint}; retrying until "
                              r"it is back \(Ctrl\+C to stop\)\n", text)) == 1, text
        assert len(re.findall(rf"\[worker\] back: reconnected to {endpoint} after \d+s away\n",
                              text)) == 1, text
        assert text.count("[worker] lost the coordinator") == 1, text
        assert text.count("[worker] back:") == 1, text
        assert text.count("joined mesh as") == 1, text
    finally:
        lab.close()
