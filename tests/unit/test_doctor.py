"""gpumesh doctor's checks, each fed plain values and fakes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gpumesh.tokens
from gpumesh.cli import doctor
from gpumesh.cli.doctor import Check, Probes, TorchFacts
from gpumesh.config import Settings, save_connection
from gpumesh.discovery import Adapter
from gpumesh.errors import AuthenticationError, ConnectionFailed
from gpumesh.sharedmem import FolderUsage
from gpumesh.tokens import loose_file_warning, parse_token

TOKEN = "abcdefghijk." + "S" * 32
GiB = 1024**3


def test_gpumesh_shadowed_by_another_copy_is_a_warning():
    same = doctor.check_gpumesh("0.1.0", Path("/site/gpumesh"), "0.1.0")
    other = doctor.check_gpumesh("0.1.0", Path("/old/gpumesh"), "0.0.9")
    assert same.status == "ok" and "/site/gpumesh" in same.summary
    assert other.status == "warn" and "0.0.9" in other.lines[0]


def test_cloudpickle_missing_is_a_fault_on_this_machine():
    def missing() -> str:
        raise ImportError("No module named 'cloudpickle'")

    check = doctor.check_cloudpickle(missing)
    assert check.status == "fault"
    assert doctor.exit_code([check]) == 1
    assert doctor.check_cloudpickle(lambda: "3.1.0").status == "ok"


def test_torch_cpu_build_while_nvidia_smi_sees_gpus_is_flagged():
    cpu_build = TorchFacts(True, "2.3.0+cpu", None, False)
    check = doctor.check_torch(cpu_build, ["NVIDIA GeForce RTX 4090"])
    assert check.status == "warn"
    assert "CPU-only build" in " ".join(check.lines)


def test_torch_cuda_build_that_sees_no_gpu_names_the_driver():
    check = doctor.check_torch(TorchFacts(True, "2.3.0", "12.1", False), ["A100", "A100"])
    assert check.status == "warn" and "driver" in " ".join(check.lines)


def test_torch_and_nvidia_smi_agreeing_is_ok_and_counts_differing_is_not():
    facts = TorchFacts(True, "2.3.0", "12.1", True, ("A100", "A100"))
    assert doctor.check_torch(facts, ["A100", "A100"]).status == "ok"
    assert doctor.check_torch(facts, ["A100"]).status == "warn"


def test_no_torch_and_no_gpu_is_plain_information():
    check = doctor.check_torch(TorchFacts(False), None)
    assert check.status == "info" and "CPU worker" in check.summary
    assert doctor.check_torch(TorchFacts(False), ["T4"]).status == "warn"


def test_config_reports_the_url_and_never_the_token(tmp_path):
    save_connection(tmp_path / "config.json", "tcp://127.0.0.1:8123", TOKEN)
    check, url, token = doctor.check_config(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}))
    assert check.status == "ok" and url == "tcp://127.0.0.1:8123" and token == TOKEN
    assert TOKEN not in json.dumps(doctor.as_document([check])) + doctor.render([check])


def test_a_url_that_is_the_token_is_a_fault_and_never_shown_nor_dialled(tmp_path):
    dialled: list[str] = []

    def connect(url, token, timeout):
        dialled.append(url)
        return []

    for environ, given in (({"GPUMESH_URL": TOKEN, "GPUMESH_TOKEN": TOKEN}, None),
                           ({"GPUMESH_TOKEN": TOKEN}, f"tcp://{TOKEN}:8000")):
        checks = doctor.report({"GPUMESH_HOME": str(tmp_path / "home"), **environ}, url=given,
                               probes=_probes(connect=connect))
        shown = json.dumps(doctor.as_document(checks)) + doctor.render(checks)
        assert TOKEN not in shown and parse_token(TOKEN).secret not in shown
        assert "is a token, not an address" in shown and doctor.exit_code(checks) == 1
    assert dialled == []
    checks = doctor.report({"GPUMESH_HOME": str(tmp_path / "home"), "GPUMESH_TOKEN": TOKEN},
                           url="tcp://[1.2.3]:8000", probes=_probes(connect=connect))
    assert "is not an IPv6 address" in doctor.render(checks) and dialled == []


def test_windows_has_no_mode_bits_to_warn_about(tmp_path, monkeypatch):
    save_connection(tmp_path / "config.json", "tcp://127.0.0.1:8123", TOKEN)
    (tmp_path / "config.json").chmod(0o644)
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "token").chmod(0o644)
    assert loose_file_warning(tmp_path / "token") is not None
    class Windows:  # os as gpumesh sees it there (pathlib here must stay POSIX)
        name = "nt"

        def __getattr__(self, attribute: str):
            return getattr(os, attribute)

    monkeypatch.setattr(doctor, "os", Windows())
    monkeypatch.setattr(gpumesh.tokens, "os", Windows())
    check, _, _ = doctor.check_config(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}))
    assert check.status == "ok"
    assert loose_file_warning(tmp_path / "token") is None


def test_damaged_config_is_a_fault_and_missing_one_a_warning(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    check, _, _ = doctor.check_config(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}))
    assert check.status == "fault"
    empty = tmp_path / "empty"
    check, url, _ = doctor.check_config(Settings.from_env({"GPUMESH_HOME": str(empty)}))
    assert check.status == "warn" and url is None
    assert not empty.exists()  # read-only: nothing created


def test_a_token_as_the_url_beside_a_damaged_config_is_never_shown(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    dialled: list[str] = []
    checks = doctor.report({"GPUMESH_HOME": str(tmp_path), "GPUMESH_URL": TOKEN,
                            "GPUMESH_TOKEN": TOKEN},
                           probes=_probes(connect=lambda u, t, s: dialled.append(u) or []))
    shown = json.dumps(doctor.as_document(checks)) + doctor.render(checks)
    assert TOKEN not in shown and parse_token(TOKEN).secret not in shown and dialled == []
    assert doctor.exit_code(checks) == 1
    # A usable GPUMESH_URL is still checked.
    checks = doctor.report({"GPUMESH_HOME": str(tmp_path), "GPUMESH_URL": "tcp://127.0.0.1:9",
                            "GPUMESH_TOKEN": TOKEN},
                           probes=_probes(connect=lambda u, t, s: dialled.append(u) or []))
    assert dialled == ["tcp://127.0.0.1:9"]


def test_cuda_that_raises_is_a_warning_not_a_traceback(monkeypatch):
    import sys
    import types

    def broken(*_):
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    cuda = types.SimpleNamespace(is_available=broken, device_count=broken, get_device_name=broken)
    fake = types.SimpleNamespace(__version__="2.9.0", version=types.SimpleNamespace(cuda="12.8"),
                                 cuda=cuda)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    facts = doctor.probe_torch()
    assert facts.installed and facts.version == "2.9.0" and "insufficient" in (facts.error or "")
    check = doctor.check_torch(facts, ["RTX 3090"])
    assert check.status == "warn" and "2.9.0 imports" in check.summary
    assert "CPU only" in " ".join(check.lines)


def test_the_json_document_is_strict_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(doctor, "report", lambda *a, **k: [
        Check("workers", "ok", "fine", (), {"score": float("nan"), "when": Path("/x")})])
    assert doctor.run(as_json=True, url=None, token=None, timeout=1.0) == 0
    document = json.loads(capsys.readouterr().out, parse_constant=lambda name: 1 / 0)
    assert document["checks"][0]["data"] == {"score": None, "when": "PosixPath('/x')"}


def test_config_readable_by_others_is_flagged(tmp_path):
    save_connection(tmp_path / "config.json", "tcp://127.0.0.1:8123", TOKEN)
    (tmp_path / "config.json").chmod(0o644)
    check, _, _ = doctor.check_config(Settings.from_env({"GPUMESH_HOME": str(tmp_path)}))
    assert check.status == "warn" and "chmod 600" in " ".join(check.lines)


def test_coordinator_that_refuses_the_token_or_does_not_answer_is_a_warning():
    def refuses(url, token, timeout):
        raise AuthenticationError("authentication failed")

    def silent(url, token, timeout):
        raise ConnectionFailed("cannot reach a coordinator at tcp://127.0.0.1:9: nothing is\n"
                               "listening there")

    check, listing = doctor.check_coordinator("tcp://127.0.0.1:9", TOKEN, 1.0, refuses)
    assert check.status == "warn" and "refuses this token" in check.summary and listing is None
    check, listing = doctor.check_coordinator("tcp://127.0.0.1:9", TOKEN, 1.0, silent)
    assert check.status == "warn" and "\n" not in check.lines[0]
    assert doctor.exit_code([check]) == 0


def test_workers_with_other_versions_are_named():
    listing = [
        {"id": "a" * 12, "hostname": "same", "alive": True, "python": "3.11",
         "gpumesh": "0.1.0", "cloudpickle": "3.1.0"},
        {"id": "b" * 12, "hostname": "older", "alive": True, "python": "3.10",
         "gpumesh": "0.1.0", "cloudpickle": "2.2.1"},
        {"id": "c" * 12, "hostname": "quiet", "alive": True},
        {"id": "d" * 12, "hostname": "gone", "alive": False, "python": "3.8"},
    ]
    check = doctor.check_workers(listing, python="3.11", gpumesh="0.1.0", cloudpickle="3.1.0")
    assert check is not None and check.status == "warn"
    text = "\n".join(check.lines)
    assert "older: differs: python 3.10 (here 3.11), cloudpickle 2.2.1 (here 3.1.0)" in text
    assert "quiet: does not report" in text and "gpumesh doctor" in text
    assert "gone" not in text
    rows = check.data["workers"]
    assert [r["differs"] for r in rows] == [[], ["python", "cloudpickle"], []]


def test_no_worker_connected_is_a_warning_and_unknown_listing_is_no_check():
    assert doctor.check_workers(None) is None
    check = doctor.check_workers([], cloudpickle="3.1.0")
    assert check is not None and check.status == "warn"


def _settings(**env: str) -> Settings:
    return Settings.from_env({"GPUMESH_HOME": "/nonexistent", **env})


ADAPTERS = [Adapter("lo", "127.0.0.1", 8, "loopback"),
            Adapter("eth0", "192.0.2.10", 24, "lan"),
            Adapter("docker0", "172.17.0.1", 16, "virtual")]


def test_addresses_flag_a_virtual_adapter_as_bind_or_coordinator():
    loop = doctor.check_addresses(_settings(), ADAPTERS, None)
    assert loop.status == "ok" and "only this machine" in loop.summary
    everywhere = doctor.check_addresses(_settings(GPUMESH_HOST="0.0.0.0"), ADAPTERS, None)
    assert everywhere.data["advertise"] == ["192.0.2.10"]
    docker = doctor.check_addresses(_settings(GPUMESH_HOST="172.17.0.1"), ADAPTERS, None)
    assert docker.status == "warn" and "virtual adapter" in " ".join(docker.lines)
    dial = doctor.check_addresses(_settings(), ADAPTERS, "tcp://172.17.0.1:8000")
    assert dial.status == "warn" and "docker0" in " ".join(dial.lines)


def test_bound_everywhere_with_no_lan_adapter_says_host_ip():
    check = doctor.check_addresses(_settings(GPUMESH_HOST="0.0.0.0"), ADAPTERS[::2], None)
    assert check.status == "warn" and "--host-ip" in " ".join(check.lines)


def test_firewall_is_read_only_and_windows_only():
    ran: list[str] = []

    def netsh(command: str) -> int:
        ran.append(command)
        return 1

    assert doctor.check_firewall(8000, system="linux", run=netsh).status == "info"
    assert ran == []
    missing = doctor.check_firewall(8000, system="win32", run=netsh)
    assert missing.status == "warn" and missing.data["exists"] is False
    assert ran == ['netsh advfirewall firewall show rule name="gpumesh 8000"']  # never "add"
    assert doctor.check_firewall(8000, system="win32", run=lambda c: 0).status == "ok"


def _probes(**changes) -> Probes:
    base = dict(torch=lambda: TorchFacts(False), nvidia_smi=lambda: None,
                adapters=lambda: ADAPTERS, connect=lambda u, t, s: [], system="linux",
                shared_memory=lambda: (Path("/dev/shm"), []), space=lambda path: (GiB, GiB))
    return Probes(**{**base, **changes})  # type: ignore[arg-type]


def test_invalid_environment_is_a_fault_and_the_report_still_prints(tmp_path):
    checks = doctor.report({"GPUMESH_HOME": str(tmp_path), "GPUMESH_HEARTBEAT": "soon"},
                           probes=_probes())
    assert checks[-1].status == "fault" and "GPUMESH_HEARTBEAT" in checks[-1].summary
    assert doctor.exit_code(checks) == 1
    assert [c.name for c in checks[:4]] == ["gpumesh", "python", "cloudpickle", "torch"]


def test_report_uses_the_saved_port_for_the_firewall_and_exits_zero_on_warnings(tmp_path):
    save_connection(tmp_path / "config.json", "tcp://127.0.0.1:8123", TOKEN)
    seen: list[tuple[str, str]] = []

    def connect(url, token, timeout):
        seen.append((url, token))
        return []

    checks = doctor.report({"GPUMESH_HOME": str(tmp_path)},
                           probes=_probes(connect=connect, system="win32", netsh=lambda c: 1))
    by_name = {c.name: c for c in checks}
    assert seen == [("tcp://127.0.0.1:8123", TOKEN)]
    assert by_name["firewall"].data["port"] == 8123
    assert by_name["workers"].status == "warn"
    assert doctor.exit_code(checks) == 0


def test_document_is_json_with_the_worst_status():
    doc = doctor.as_document([Check("a", "ok", "fine"), Check("b", "warn", "hmm", ("x",))])
    assert doc["status"] == "warn" and doc["report"] == 1
    assert json.loads(json.dumps(doc))["checks"][1]["lines"] == ["x"]


def test_shared_memory_of_a_container_is_a_warning_that_says_how_to_grow_it():
    small = doctor.check_shared_memory(True, Path("/dev/shm"), (64 * 1024**2, 60 * 1024**2), [])
    assert small.status == "warn" and "64.0 MiB" in small.summary
    assert any("--shm-size" in line for line in small.lines)
    roomy = doctor.check_shared_memory(True, Path("/dev/shm"), (8 * GiB, 6 * GiB), [])
    assert roomy.status == "ok" and roomy.summary == "/dev/shm: 6.0 GiB free of 8.0 GiB"


def test_shared_memory_off_or_missing_is_plain_information():
    usage = [FolderUsage(Path("/tmp/gpumesh-1-k"), 2, 3 * 1024**2, "/home/a/.gpumesh/j.db")]
    for check in (doctor.check_shared_memory(False, Path("/dev/shm"), None, []),
                  doctor.check_shared_memory(True, Path("/dev/shm"), None, [], system="win32"),
                  doctor.check_shared_memory(True, Path("/tmp"), None, usage)):
        assert check.status == "info"
    assert "sockets" in doctor.check_shared_memory(False, Path("/dev/shm"), None, []).summary


def test_shared_memory_says_what_coordinators_frames_hold_and_whose_they_are():
    usage = [FolderUsage(Path(f"/dev/shm/gpumesh-1-{i}"), 2, (2 - i) * 1024**2,
                         "/home/a/\x1b[2Jj.db" if i == 0 else "") for i in range(3)]
    check = doctor.check_shared_memory(True, Path("/dev/shm"), (8 * GiB, 8 * GiB), usage)
    assert check.lines[0] == "gpumesh's frames there: 3.0 MiB in 6 file(s), 3 coordinator folder(s)"
    assert "2.0 MiB" in check.lines[1] and "\x1b" not in check.lines[1]  # a terminal's escape
    assert check.lines[2].endswith("(a journal in memory)")
    assert len(check.lines) == 3  # a folder holding nothing is not listed
    assert check.data["bytes"] == 3 * 1024**2


def test_the_survey_of_shared_memory_reads_sizes_and_journals_only(tmp_path, monkeypatch):
    from gpumesh.sharedmem import SharedFolder, survey

    monkeypatch.setattr("gpumesh.sharedmem._base", lambda: tmp_path)
    folder = SharedFolder.create("k", str(tmp_path / "j.db"))
    assert folder is not None
    try:
        name = folder.write([bytes(256 * 1024)])
        before = sorted(p.name for p in folder.path.iterdir())
        base, found = survey()
        assert base == tmp_path and len(found) == 1
        assert found[0].frames == 1 and found[0].nbytes >= 256 * 1024
        assert found[0].journal == str(tmp_path / "j.db")
        assert sorted(p.name for p in folder.path.iterdir()) == before  # changes nothing
        folder.remove([name])
    finally:
        folder.close()


def test_the_report_ends_with_shared_memory():
    checks = doctor.report({}, probes=_probes(space=lambda path: (64 * 1024**2, 0)))
    assert checks[-1].name == "shared-memory" and checks[-1].status == "warn"


def test_a_coordinator_given_with_url_is_no_warning_that_none_is_configured(tmp_path):
    # `doctor --url U` warned "no coordinator configured" beside U's own OK line.
    checks = doctor.report({"GPUMESH_HOME": str(tmp_path)}, url="tcp://127.0.0.1:8123",
                           token=TOKEN, probes=_probes())
    config = {c.name: c for c in checks}["config"]
    assert config.status == "info" and "--url" in config.summary
    alone = {c.name: c for c in doctor.report({"GPUMESH_HOME": str(tmp_path)},
                                              probes=_probes())}["config"]
    assert alone.status == "warn" and alone.summary == "no coordinator configured"
