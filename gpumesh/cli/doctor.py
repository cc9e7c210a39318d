"""``gpumesh doctor``: a read-only report on this machine and its saved mesh, to paste in an issue.

Each check is a function of plain inputs (the settings, what a probe found, a connect callable)
returning one ``Check``, so the checks are tested with fakes; ``run`` only gathers the inputs
and prints. Nothing here writes a file, adds a firewall rule, saves a connection or prints the
token. Only a fault on this machine (a package that cannot be imported, a config that cannot be
read) is a ``fault`` and exits 1; a missing or unreachable coordinator is a warning, so the
command works as a pre-flight check in a script.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import click

from .._version import __version__
from ..config import Settings, parse_url
from ..discovery import Adapter, adapters, advertised_addresses, binds_everywhere, lan_addresses
from ..errors import AuthenticationError, ConfigError, MeshError
from ..firewall import rule_name, run_netsh, show_rule_command
from ..protocol.fields import for_terminal
from ..sharedmem import FolderUsage, survey
from ..tokens import weak_warning

Status = Literal["ok", "info", "warn", "fault"]
REPORT_VERSION = 1
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
_TAG = {"ok": "[OK]   ", "info": "[INFO] ", "warn": "[WARN] ", "fault": "[FAULT]"}
_COLOUR = {"ok": "green", "info": None, "warn": "yellow", "fault": "red"}


@dataclass(frozen=True)
class Check:
    """One line of the report: ``name`` (stable, for --json), a status, a one-line summary,
    indented detail lines, and the values behind them."""

    name: str
    status: Status
    summary: str
    lines: tuple[str, ...] = ()
    data: Mapping[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- this machine

def check_gpumesh(version: str = __version__, package: Path | None = None,
                  installed: str | None = None) -> Check:
    """Which gpumesh is imported and from where; a different installed distribution is a warning
    (an old copy shadowing the one you installed)."""
    if package is None:
        package = Path(__file__).resolve().parents[1]
    if installed is None:
        installed = _distribution_version("gpumesh")
    data = {"version": version, "path": str(package), "installed": installed}
    summary = f"gpumesh {version} imported from {package}"
    if installed is not None and installed != version:
        return Check("gpumesh", "warn", summary, (
            f"but the installed distribution says {installed}: another copy shadows it "
            "(check sys.path and the current folder)",), data)
    return Check("gpumesh", "ok", summary, (), data)


def check_python(version: str | None = None, executable: str = sys.executable,
                 system: str | None = None) -> Check:
    version = version or platform.python_version()
    system = system or f"{platform.system()} {platform.machine()}"
    return Check("python", "ok", f"Python {version} ({executable})", (system,),
                 {"version": version, "executable": executable, "platform": system})


def check_cloudpickle(version: Callable[[], str] | None = None) -> Check:
    """cloudpickle carries every function task: without it nothing runs, so it is a fault."""
    try:
        found = version() if version is not None else _cloudpickle_version()
    except ImportError as exc:
        return Check("cloudpickle", "fault", f"cloudpickle cannot be imported: {exc}",
                     ("reinstall gpumesh: pip install --force-reinstall gpumesh",),
                     {"version": None})
    return Check("cloudpickle", "ok", f"cloudpickle {found}", (), {"version": found})


@dataclass(frozen=True)
class TorchFacts:
    """What torch says about CUDA, or ``installed=False``."""

    installed: bool
    version: str | None = None
    cuda_build: str | None = None  # torch.version.cuda: None on a CPU-only build
    cuda_available: bool = False
    devices: tuple[str, ...] = ()
    error: str | None = None


def probe_torch() -> TorchFacts:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return TorchFacts(installed=False)
    try:
        import torch
    except Exception as exc:  # a broken torch install says why in many ways
        return TorchFacts(installed=True, error=f"{type(exc).__name__}: {exc}")
    version, build = str(torch.__version__), getattr(torch.version, "cuda", None)
    try:
        # On the machines doctor is for, these raise: a driver too old for this CUDA, a GPU
        # fallen off the bus, CUDA_VISIBLE_DEVICES naming one that is not there.
        available = bool(torch.cuda.is_available())
        names = tuple(torch.cuda.get_device_name(i)
                      for i in range(torch.cuda.device_count())) if available else ()
    except Exception as exc:
        return TorchFacts(True, version, build, error=f"CUDA: {type(exc).__name__}: {exc}")
    return TorchFacts(True, version, build, available, names)


def probe_nvidia_smi(which: Callable[[str], str | None] = shutil.which) -> list[str] | None:
    """The GPU names ``nvidia-smi`` lists; None when it is not installed or does not answer."""
    path = which("nvidia-smi")
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def check_torch(torch: TorchFacts, smi: list[str] | None) -> Check:
    """torch and CUDA, and whether ``nvidia-smi`` disagrees (GPUs torch cannot use)."""
    data: dict[str, Any] = {**asdict(torch), "nvidia_smi": smi}
    smi_line = ("nvidia-smi: not found" if smi is None
                else f"nvidia-smi: {len(smi)} GPU(s){': ' + ', '.join(smi) if smi else ''}")
    if torch.error is not None and torch.version is not None:
        return Check("torch", "warn", f"torch {torch.version} imports, but its {torch.error}", (
            smi_line, "this machine joins as CPU only: the driver may be older than this "
            "torch's CUDA, or CUDA_VISIBLE_DEVICES names a GPU that is not there"), data)
    if torch.error is not None:
        return Check("torch", "warn", f"torch is installed but does not import: {torch.error}",
                     (smi_line, "this machine joins as CPU only until torch imports"), data)
    if not torch.installed:
        if smi:
            return Check("torch", "warn", "torch is not installed, but nvidia-smi sees "
                         f"{len(smi)} GPU(s)", (smi_line, "install a CUDA build of torch "
                                                "(https://pytorch.org) so tasks can use them"), data)
        return Check("torch", "info", "torch is not installed: this machine works as a CPU "
                     "worker", (smi_line,), data)
    build = f"CUDA {torch.cuda_build}" if torch.cuda_build else "CPU-only build"
    if torch.cuda_available:
        summary = f"torch {torch.version} ({build}): {len(torch.devices)} GPU(s): " \
                  f"{', '.join(torch.devices)}"
        if smi is not None and len(smi) != len(torch.devices):
            return Check("torch", "warn", summary, (
                smi_line, "torch and nvidia-smi disagree on the GPU count: check "
                "CUDA_VISIBLE_DEVICES"), data)
        return Check("torch", "ok", summary, (smi_line,), data)
    summary = f"torch {torch.version} ({build}): no CUDA device"
    if smi:
        why = ("this torch is a CPU-only build: install a CUDA build (https://pytorch.org)"
               if not torch.cuda_build else
               "torch cannot use them: the driver may be older than this torch's CUDA "
               f"{torch.cuda_build}, or CUDA_VISIBLE_DEVICES hides them")
        return Check("torch", "warn", summary + f", but nvidia-smi sees {len(smi)} GPU(s)",
                     (smi_line, why), data)
    return Check("torch", "info", summary, (smi_line,), data)


# ----------------------------------------------------------------------------- the config

def check_config(settings: Settings) -> tuple[Check, str | None, str | None]:
    """The coordinator this machine would use, and the token (returned, never shown)."""
    path = settings.config_path
    try:
        saved = settings.saved_connection()
    except ConfigError as exc:
        # GPUMESH_URL may still be checked, once it parses: unparsed, it may be the token
        # itself (set in the wrong variable), and the coordinator's line would quote it.
        url = settings.url
        if url is not None:
            try:
                parse_url(url, settings.token)
            except ConfigError:
                url = None
        return Check("config", "fault", f"cannot read the saved connection: {exc}",
                     data={"path": str(path)}), url, settings.token
    url = settings.url or (saved.url if saved else None)
    token = settings.token or (saved.token if saved else None)
    source = ("GPUMESH_URL" if settings.url else f"saved in {path}" if saved else None)
    if url is not None:
        try:
            parse_url(url, token)
        except ConfigError as exc:  # its message never quotes a URL that holds the token
            return Check("config", "fault", f"the coordinator URL ({source}) cannot be used",
                         (str(exc),), data={"path": str(path), "url": None,
                                            "url_from": source}), None, token
    data: dict[str, Any] = {"path": str(path), "saved": saved is not None, "url": url,
                            "url_from": source, "token": "set" if token else "missing",
                            "token_from": "GPUMESH_TOKEN" if settings.token
                            else "saved" if saved else None}
    lines = []
    status: Status = "ok"
    if url is None:
        return Check("config", "warn", "no coordinator configured", (
            "run 'gpumesh serve' here, or 'gpumesh join URL --token-file FILE', or set "
            "GPUMESH_URL",), data), None, token
    if token is None:
        status = "warn"
        lines.append("no token: set GPUMESH_TOKEN or run 'gpumesh join ... --token-file FILE'")
    else:
        lines.append(f"token: set ({data['token_from']}; never shown)")
        weak = weak_warning(token)
        if weak:
            status = "warn"
            lines.append(f"the token is weak: {weak}")
    loose = _loose(path) if saved else None
    if loose:
        status = "warn"
        lines.append(loose)
    return Check("config", status, f"coordinator {url} ({source})", tuple(lines), data), url, token


def _loose(path: Path) -> str | None:
    if os.name == "nt":
        return None  # no mode bits there: every file reads 0666, and chmod cannot change it
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    if mode & 0o077:
        return f"{path} is readable by other users (mode {mode:04o}): chmod 600 {path}"
    return None


# ----------------------------------------------------------------------------- the mesh

Connect = Callable[[str, str, float], list[dict[str, Any]]]


def connect_and_list(url: str, token: str, timeout: float, settings: Settings) -> list[dict[str, Any]]:
    """The coordinator's worker list; ConnectionFailed/AuthenticationError when it does not
    answer. A client session saves nothing."""
    from ..client import GPUMesh

    with GPUMesh(url, token, quiet=True, connect_timeout=timeout, settings=settings) as client:
        return client.workers()


def check_coordinator(url: str | None, token: str | None, timeout: float,
                      connect: Connect) -> tuple[Check, list[dict[str, Any]] | None]:
    if url is None or token is None:
        return Check("coordinator", "info", "not checked: no coordinator or token configured"), None
    data: dict[str, Any] = {"url": url, "answers": False}
    try:
        listing = connect(url, token, timeout)
    except AuthenticationError:
        return Check("coordinator", "warn", f"{url} answers, but refuses this token", (
            "the saved or given token is not this mesh's: copy the coordinator's "
            "~/.gpumesh/token here and pass --token-file",), data), None
    except MeshError as exc:
        return Check("coordinator", "warn", f"{url} does not answer", (
            _one_line(str(exc)),), data), None
    data["answers"] = True
    alive = [w for w in listing if w.get("alive")]
    data["workers"] = len(alive)
    return Check("coordinator", "ok", f"{url} answers: {len(alive)} worker(s) alive",
                 data=data), listing


def check_workers(listing: Sequence[Mapping[str, Any]] | None, *, python: str = PYTHON,
                  gpumesh: str = __version__, cloudpickle: str | None = None) -> Check | None:
    """Connected workers whose Python (major.minor), gpumesh or cloudpickle differ from here:
    the usual cause of a NameError or an unpicklable function on one machine only."""
    if listing is None:
        return None
    cloudpickle = cloudpickle if cloudpickle is not None else _safe_cloudpickle()
    mine = {"python": python, "gpumesh": gpumesh, "cloudpickle": cloudpickle}
    lines: list[str] = []
    rows: list[dict[str, Any]] = []
    differing = unknown = 0
    for worker in listing:
        if not worker.get("alive"):
            continue
        theirs = {key: str(worker.get(key) or "") for key in mine}
        diff = [f"{key} {theirs[key]} (here {mine[key]})" for key in mine
                if theirs[key] and mine[key] and theirs[key] != mine[key]]
        missing = [key for key in mine if not theirs[key]]
        label = f"{str(worker.get('id', ''))[:8]} {worker.get('hostname', '')}".strip()
        row = {"id": worker.get("id"), "hostname": worker.get("hostname"),
               "device": worker.get("device"), "score": worker.get("score"), **theirs,
               "differs": [d.split(" ", 1)[0] for d in diff]}
        rows.append(row)
        if diff:
            differing += 1
            lines.append(f"{label}: differs: {', '.join(diff)}")
        elif missing:
            unknown += 1
            lines.append(f"{label}: does not report {', '.join(missing)}: run 'gpumesh doctor' "
                         "on that machine and compare the Python lines")
        else:
            lines.append(f"{label}: {worker.get('device', 'CPU')} score="
                         f"{float(worker.get('score') or 0):.3f}, same versions")
    data = {"here": mine, "workers": rows}
    if not rows:
        return Check("workers", "warn", "no worker is connected: @mesh calls run locally",
                     ("start one with 'gpumesh join URL --token-file FILE' (or 'gpumesh serve' "
                      "without --no-self-worker)",), data)
    if differing:
        return Check("workers", "warn", f"{differing} of {len(rows)} worker(s) run other "
                     "versions than this machine", tuple(lines), data)
    return Check("workers", "info" if unknown else "ok",
                 f"{len(rows)} worker(s), versions as here", tuple(lines), data)


def check_addresses(settings: Settings, found: Sequence[Adapter], url: str | None) -> Check:
    """The address serve would bind and what it would advertise, flagging virtual adapters: an
    address only this machine routes to costs an afternoon of timeouts on the other machines."""
    host = settings.host
    advertised = advertised_addresses(host) if not binds_everywhere(host) else \
        lan_addresses(found)
    by_address = {a.address: a for a in found}
    lines = [f"{a.name}: {a.address}/{a.prefix} ({a.kind})" for a in found]
    data: dict[str, Any] = {"bind": host, "advertise": advertised,
                            "adapters": [asdict(a) for a in found],
                            "discovery": settings.discovery,
                            "discovery_interfaces": list(settings.discovery_interfaces)}
    status: Status = "ok"
    if host in ("127.0.0.1", "localhost", "::1"):
        summary = (f"serve binds {host}: only this machine can reach it (--host 0.0.0.0 opens "
                   "it)")
    else:
        summary = f"serve binds {host}, advertises {', '.join(advertised) or 'nothing'}"
        if binds_everywhere(host) and not advertised:
            status = "warn"
            lines.append("no LAN adapter found (only loopback, container, VM or VPN ones): pass "
                         "--host-ip with the address other machines dial")
    chosen = by_address.get(host)
    if chosen is not None and chosen.kind in ("virtual", "vpn"):
        status = "warn"
        lines.append(f"GPUMESH_HOST {host} is on {chosen.name}, a {chosen.kind} adapter: other "
                     "machines on the LAN usually cannot route to it")
    if url is not None:
        try:
            target = parse_url(url).host
        except ConfigError:
            target = ""
        adapter = by_address.get(target)
        if adapter is not None and adapter.kind in ("virtual", "vpn"):
            status = "warn"
            lines.append(f"the configured coordinator {target} is on {adapter.name}, a "
                         f"{adapter.kind} adapter: machines off it cannot reach it")
    if not settings.discovery:
        lines.append("LAN discovery is off (GPUMESH_DISCOVERY=0)")
    return Check("addresses", status, summary, tuple(lines), data)


def check_firewall(port: int, *, system: str = sys.platform,
                   run: Callable[[str], int] = run_netsh) -> Check:
    """Windows only: whether the inbound rule ``serve`` adds exists. Reads, never adds."""
    data = {"platform": system, "port": port, "rule": rule_name(port)}
    if system != "win32":
        return Check("firewall", "info", "not Windows: no firewall rule to check", data=data)
    if run(show_rule_command(port)) == 0:
        return Check("firewall", "ok", f"Windows firewall rule \"{rule_name(port)}\" allows "
                     f"inbound TCP {port}", data={**data, "exists": True})
    return Check("firewall", "warn", f"no Windows firewall rule \"{rule_name(port)}\": other "
                 "machines may be blocked", ("'gpumesh serve --host 0.0.0.0' run as "
                                            "Administrator adds it",), {**data, "exists": False})


# Under this, /dev/shm is a container's (Docker gives 64 MiB): big frames that do not fit in it
# go through the encrypted sockets instead, several times slower (bench/README.md).
SMALL_SHM_BYTES = 256 * 1024 * 1024


def probe_space(path: Path) -> tuple[int, int] | None:
    """(total, free) bytes of the file system holding ``path``; None where unknown."""
    try:
        fs = os.statvfs(path)
    except (OSError, AttributeError):  # Windows has no statvfs
        return None
    return fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize


def check_shared_memory(enabled: bool, base: Path, space: tuple[int, int] | None,
                        folders: Sequence[FolderUsage], *, system: str = sys.platform) -> Check:
    """Where big arguments and results between processes of this machine go, how much room
    there is, and what coordinators' frames hold there now (memory: /dev/shm is RAM)."""
    if system == "win32":
        return Check("shared-memory", "info", "no shared memory on Windows: big arguments "
                     "and results go through the sockets")
    if not enabled:
        return Check("shared-memory", "info", "shared memory is off (GPUMESH_SHARED_MEMORY=0): "
                     "big arguments and results go through the sockets")
    held = sum(f.nbytes for f in folders)
    data: dict[str, Any] = {"path": str(base), "frames": sum(f.frames for f in folders),
                            "bytes": held, "folders": len(folders)}
    lines = []
    if folders:
        lines.append(f"gpumesh's frames there: {_size(held)} in {data['frames']} file(s), "
                     f"{len(folders)} coordinator folder(s)")
        for usage in [f for f in folders if f.nbytes][:3]:
            journal = for_terminal(usage.journal) or "a journal in memory"
            lines.append(f"{usage.path}: {_size(usage.nbytes)} ({journal})")
    if str(base) != "/dev/shm":
        return Check("shared-memory", "info", f"no /dev/shm: big frames are files in {base}",
                     tuple(lines), data)
    if space is None:
        return Check("shared-memory", "info", "/dev/shm: its size is unknown", tuple(lines), data)
    total, free = space
    data.update(total=total, free=free)
    summary = f"/dev/shm: {_size(free)} free of {_size(total)}"
    if total < SMALL_SHM_BYTES:
        return Check("shared-memory", "warn", summary + " (a container's?)", (
            "big arguments and results that do not fit go through the sockets, several times "
            "slower: start the container with --shm-size=2g (or --ipc=host)", *lines), data)
    return Check("shared-memory", "ok", summary, tuple(lines), data)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


# ----------------------------------------------------------------------------- the report

@dataclass(frozen=True)
class Probes:
    """Everything ``report`` reads from the machine, injectable for tests."""

    torch: Callable[[], TorchFacts] = probe_torch
    nvidia_smi: Callable[[], list[str] | None] = probe_nvidia_smi
    adapters: Callable[[], list[Adapter]] = adapters
    connect: Connect | None = None
    system: str = sys.platform
    netsh: Callable[[str], int] = run_netsh
    shared_memory: Callable[[], tuple[Path, list[FolderUsage]]] = survey
    space: Callable[[Path], tuple[int, int] | None] = probe_space


def report(environ: Mapping[str, str], *, url: str | None = None, token: str | None = None,
           timeout: float = 3.0, probes: Probes | None = None) -> list[Check]:
    """Every check, in the order they print. ``url``/``token`` override the configured ones."""
    probes = probes or Probes()
    checks = [check_gpumesh(), check_python(), check_cloudpickle(),
              check_torch(probes.torch(), probes.nvidia_smi())]
    try:
        settings = Settings.from_env(environ)
    except ConfigError as exc:
        checks.append(Check("settings", "fault", f"the GPUMESH_* environment is invalid: {exc}"))
        return checks
    config, saved_url, saved_token = check_config(settings)
    if url is not None and saved_url is None and config.status == "warn":
        # Nothing configured is a warning when nothing is given either: with --url, the
        # coordinator to check is known (it read as a warning beside that coordinator's OK).
        config = Check("config", "info", "no coordinator saved or set on this machine: "
                       "checking the one given with --url", data=config.data)
    url, token = url or saved_url, token or saved_token
    checks.append(config)
    if url is not None and (url, token) != (saved_url, saved_token):
        try:  # --url or --token given: check_config judged only the configured pair
            parse_url(url, token)
        except ConfigError as exc:
            checks.append(Check("url", "fault", "the coordinator URL given cannot be used",
                                (str(exc),)))
            url = None
    connect = probes.connect or (lambda u, t, s: connect_and_list(u, t, s, settings))
    coordinator, listing = check_coordinator(url, token, timeout, connect)
    checks.append(coordinator)
    workers = check_workers(listing)
    if workers is not None:
        checks.append(workers)
    try:
        found = probes.adapters()
    except Exception as exc:  # ifaddr reads OS tables; a failure must not hide the rest
        checks.append(Check("addresses", "warn", f"cannot list network adapters: {exc}"))
    else:
        checks.append(check_addresses(settings, found, url))
    port = _port(url)
    checks.append(check_firewall(port, system=probes.system, run=probes.netsh))
    base, folders = probes.shared_memory()
    checks.append(check_shared_memory(settings.share_memory, base, probes.space(base), folders,
                                      system=probes.system))
    return checks


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.status == "fault" for c in checks) else 0


def as_document(checks: Sequence[Check]) -> dict[str, Any]:
    worst = next((s for s in ("fault", "warn") if any(c.status == s for c in checks)), "ok")
    return {"report": REPORT_VERSION, "status": worst,
            "checks": [{"name": c.name, "status": c.status, "summary": c.summary,
                        "lines": list(c.lines), "data": dict(c.data)} for c in checks]}


def render(checks: Sequence[Check], colour: bool = False) -> str:
    out = []
    for c in checks:
        tag = _TAG[c.status]
        if colour and _COLOUR[c.status]:
            tag = click.style(tag, fg=_COLOUR[c.status], bold=True)
        out.append(f"{tag} {c.summary}")
        out.extend(f"         {line}" for line in c.lines)
    faults = sum(c.status == "fault" for c in checks)
    warnings = sum(c.status == "warn" for c in checks)
    out.append("")
    out.append(f"{faults} fault(s), {warnings} warning(s). doctor changes nothing and never "
               "shows the token: paste this report in an issue as it is.")
    return "\n".join(out) + "\n"


def run(*, as_json: bool, url: str | None, token: str | None, timeout: float,
        probes: Probes | None = None) -> int:
    from .output import color_enabled, json_text

    checks = report(os.environ, url=url, token=token, timeout=timeout, probes=probes)
    if as_json:
        for c in checks:
            if c.status in ("warn", "fault"):
                click.echo(f"{c.status}: {c.summary}", err=True)
        click.echo(json_text(as_document(checks)))
    else:
        click.echo(render(checks, color_enabled()), nl=False, color=color_enabled())
    return exit_code(checks)


def _port(url: str | None) -> int:
    from ..config import DEFAULT_PORT

    if url is None:
        return DEFAULT_PORT
    try:
        return parse_url(url).port
    except ConfigError:
        return DEFAULT_PORT


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cloudpickle_version() -> str:
    import cloudpickle

    return str(cloudpickle.__version__)


def _safe_cloudpickle() -> str:
    try:
        return _cloudpickle_version()
    except ImportError:
        return ""
