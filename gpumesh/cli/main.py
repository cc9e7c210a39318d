"""``gpumesh``: the command-line entry point (click wiring only)."""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from .._version import __version__
from ..config import DEFAULT_PORT, YEAR, Settings
from ..errors import MeshError
from .output import fail, json_text, setup_logging, worker_table
from .tokens import chosen_token, prime_key_cache, token_options

if TYPE_CHECKING:
    from ..client import GPUMesh

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")

VERSION_LINE = f"gpumesh {__version__} ({platform.python_version()}, {platform.system()})"


class _Seconds(click.FloatRange):
    """A duration in seconds within a range: click's FloatRange lets "nan" through (no
    comparison with NaN is true) and "inf" past a range without a top."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return number


def _settings() -> Settings:
    try:
        settings = Settings.from_env()
    except MeshError as exc:
        fail(str(exc))
    prime_key_cache(settings)
    return settings


def _color_option(fn: _F) -> _F:
    """``--color`` / ``--no-color``: one choice, so giving both is an error, not "last wins"."""
    def set_color(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if not value:
            return
        chosen = param.name == "color"
        earlier = ctx.meta.get("gpumesh.color")
        if earlier is not None and earlier != chosen:
            raise click.UsageError("--color and --no-color contradict each other: give one")
        ctx.meta["gpumesh.color"] = chosen
        # The flag works through the variable, so runner children inherit the choice.
        os.environ["GPUMESH_COLOR"] = "1" if chosen else "0"

    fn = click.option("--no-color", "no_color", is_flag=True, expose_value=False,
                      callback=set_color, help="Never colour the output.")(fn)
    return click.option("--color", "color", is_flag=True, expose_value=False,
                        callback=set_color,
                        help="Colour the output even when it is not a terminal.")(fn)


def _dashboard_options(fn: _F) -> _F:
    fn = click.option("--dashboard-key", type=click.Path(dir_okay=False), default=None,
                      metavar="FILE", help="PEM private key of --dashboard-cert.")(fn)
    fn = click.option("--dashboard-cert", type=click.Path(dir_okay=False), default=None,
                      metavar="FILE",
                      help="Serve the page over HTTPS with this PEM certificate (with "
                           "--dashboard-key). Off loopback without it, a self-signed one is "
                           "made with openssl and kept in GPUMESH_HOME.")(fn)
    fn = click.option("--dashboard-port", default=8265, show_default=True,
                      type=click.IntRange(0, 65535),
                      help="TCP port of the dashboard page (0 picks a free one).")(fn)
    return click.option("--dashboard-host", default="127.0.0.1", show_default=True,
                        help="Address the dashboard binds. Any other than loopback serves "
                             "HTTPS and asks visitors for the mesh token.")(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", message=VERSION_LINE)
@click.option("-v", "--verbose", is_flag=True, help="Debug-level logging on stderr.")
@click.option("--json-logs", is_flag=True, help="Emit logs as JSON lines (for Docker, journald).")
def cli(verbose: bool, json_logs: bool) -> None:
    """Borrow your friends' GPUs: one coordinator, workers on your machines, Python across all.

    \b
    Quick start (one machine):
      gpumesh serve --port 8000          # coordinator + this machine as a worker
                                         # (makes a token, saved in ~/.gpumesh/token)
      python demo.py                     # code using @mesh runs on the mesh
    Try it all in one go:
      gpumesh demo
    """
    setup_logging(verbose, json_logs)


@cli.command()
@click.option("--host", default=None, help="Address to bind (default GPUMESH_HOST, else the "
              "one this machine's coordinator saved, else 127.0.0.1). 0.0.0.0 lets other "
              "machines join.")
@click.option("--port", default=None, type=click.IntRange(0, 65535),
              help=f"TCP port (0 picks a free one). Default: the one this machine's "
                   f"coordinator saved, else {DEFAULT_PORT}.")
@click.option("--host-ip", default=None, metavar="IP",
              help="The address other machines should dial, advertised on the LAN and printed "
                   "(default: this machine's LAN address; set it when that is a VPN or VM "
                   "adapter). It does not open the port: --host does.")
@click.option("--tailscale", is_flag=True,
              help="Bind to this machine's Tailscale address (from 'tailscale ip -4'; --host "
                   "overrides the bind) and print the join command with it.")
@click.option("--public", is_flag=True,
              help="Open an ngrok TCP tunnel (pip install 'gpumesh[tunnel]', an ngrok account) "
                   "and print its tcp:// address: anyone with the token can then join. Closed "
                   "when serve stops.")
@token_options(envvar=True, what="(or GPUMESH_TOKEN; else the one this machine's coordinator "
                                "saved; generated when none is, and saved unless --no-save)")
@click.option("--weak-token", is_flag=True, envvar="GPUMESH_WEAK_TOKEN",
              help="Accept a token shorter than 22 characters (or GPUMESH_WEAK_TOKEN=1). A short "
                   "token can be guessed offline from one recorded handshake.")
@click.option("--db", type=click.Path(dir_okay=False), default=None,
              help="SQLite journal (default GPUMESH_HOME/coordinator-PORT.db). ':memory:' "
                   "keeps it in memory, for a throwaway mesh: nothing survives a restart.")
@click.option("--no-self-worker", is_flag=True, help="Do not join this machine as a worker.")
@click.option("--slots", type=click.IntRange(1, 1024), default=None,
              help="Slots of the self-worker (default: one per GPU, else per core up to 4).")
@click.option("--safe-mode", is_flag=True, help="Refuse pickled functions; accept scripts only.")
@click.option("--pending-timeout", type=_Seconds(0.1, YEAR), default=None,
              help="Seconds an unschedulable task waits before it fails (default 60).")
@click.option("--no-save", is_flag=True, help="Do not save this connection as the default.")
@click.option("--dashboard", is_flag=True,
              help="Also serve the live web dashboard (see 'gpumesh dashboard'); it stops "
                   "with serve.")
@_dashboard_options
@click.option("--quiet-worker", is_flag=True, hidden=True)
@click.option("--ready-fd", type=int, default=None, hidden=True)
@click.option("--exit-with-parent", is_flag=True, hidden=True)
@_color_option
def serve(host: str | None, port: int | None, host_ip: str | None, tailscale: bool, public: bool,
          token: str | None, weak_token: bool, db: str | None,
          no_self_worker: bool, slots: int | None, safe_mode: bool,
          pending_timeout: float | None, no_save: bool, dashboard: bool, dashboard_host: str,
          dashboard_port: int, dashboard_cert: str | None, dashboard_key: str | None,
          quiet_worker: bool,
          ready_fd: int | None, exit_with_parent: bool) -> None:
    """Start a coordinator (and join this machine to it).

    \b
    Examples:
      gpumesh serve --port 8000                       # makes a token: ~/.gpumesh/token
      gpumesh serve                                   # again: the saved token and port
      gpumesh serve --port 8000 --token-file mesh.token
      GPUMESH_TOKEN=$(cat mesh.token) gpumesh serve --host 0.0.0.0   # let others join
      gpumesh serve --port 8000 --tailscale           # join via the Tailscale address
      gpumesh serve --port 8000 --public              # join from anywhere (ngrok)
      gpumesh serve --dashboard                       # and a live page on 127.0.0.1:8265

    On Windows, a bind beyond loopback adds the firewall rule "gpumesh PORT" when run as
    Administrator (kept for the next run), and otherwise prints the command to run.
    """
    if dashboard and (dashboard_cert is None) != (dashboard_key is None):
        raise click.UsageError("give both --dashboard-cert and --dashboard-key, or neither")
    settings = _settings()
    token = chosen_token(token)
    if token:
        # The token's scrypt (0.4 s, GIL released) starts now, beside the imports below.
        from ..security import stretch_in_background

        stretch_in_background(token)
    from .serve import serve as run_serve

    run_serve(settings, host=host, port=port, token=token, db=db, host_ip=host_ip,
              tailscale=tailscale, public=public,
              weak_token=weak_token or settings.weak_token,
              self_worker=not no_self_worker, slots=slots, safe_mode=safe_mode,
              pending_timeout=pending_timeout, ready_fd=ready_fd, quiet=quiet_worker,
              save=not no_save, exit_with_parent=exit_with_parent,
              dashboard=(dashboard_host, dashboard_port, dashboard_cert, dashboard_key)
              if dashboard else None)


def _prefetch(value: str) -> int | None:
    """``auto`` (None) or a count from 0 to 256."""
    if value.strip().lower() == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number or 'auto'") from None
    if not 0 <= count <= 256:
        raise click.BadParameter(f"{count} is not between 0 and 256")
    return count


@cli.command()
@click.argument("url", required=False)
@token_options(envvar=True, what="(or GPUMESH_TOKEN; else the saved connection's)")
@click.option("--slots", type=click.IntRange(1, 1024), default=None,
              help="Tasks run at once (default: one per GPU, else one per core up to 4).")
@click.option("--max-slots", type=click.IntRange(1, 1024), default=None,
              help="Never run more than this many tasks at once, whatever the machine has.")
@click.option("--prefetch", default="auto", show_default=True, metavar="N|auto",
              callback=lambda ctx, param, value: _prefetch(value),
              help="Extra tasks to hold queued beyond the slots. 'auto' queues a few while "
                   "tasks are short (under 0.2 s), which hides the round trip, and none "
                   "otherwise; 0 never queues.")
@click.option("--no-benchmark", is_flag=True, help="Skip the join benchmark (score 0).")
@click.option("--rebenchmark", is_flag=True,
              help="Measure the benchmark again instead of reusing this machine's figures "
                   "(kept in GPUMESH_HOME/benchmark.json for 30 days).")
@click.option("--pass-env", "pass_env", multiple=True, metavar="NAME",
              help="Give every task this machine's value of variable NAME (repeatable). Tasks "
                   "otherwise see only PATH, HOME, the locale and the like.")
@click.option("--no-save", is_flag=True, help="Do not save this connection as the default.")
@click.option("--ready-fd", type=int, default=None, hidden=True)
@click.option("--exit-with-parent", is_flag=True, hidden=True)
@_color_option
def join(url: str | None, token: str | None, slots: int | None, max_slots: int | None,
         prefetch: int | None,
         no_benchmark: bool, rebenchmark: bool, pass_env: tuple[str, ...], no_save: bool,
         ready_fd: int | None,
         exit_with_parent: bool) -> None:
    """Join this machine to a coordinator as a worker.

    Without URL, token or --slots, it takes them from the connection saved on this machine
    (by 'gpumesh setup', or the last join or serve). With no URL saved either, it finds the
    coordinator of this token's mesh on the LAN (zeroconf). Either way it looks on the LAN
    again if that coordinator moves. The benchmark's figures are kept per machine
    (--rebenchmark measures again). The machine's owner can take it back at any time with
    'gpumesh pause', 'resume' and 'drain', run on this machine.

    \b
    Example:
      gpumesh join                                             # the saved connection
      gpumesh join --token-file mesh.token                     # saved URL, else the LAN
      gpumesh join tcp://192.0.2.10:8000 --token-file mesh.token
      gpumesh join tcp://192.0.2.10:8000 --token-file mesh.token --max-slots 1  # one GPU only
      gpumesh join tcp://192.0.2.10:8000 --token-file mesh.token --pass-env HF_HOME
    """
    from .join import join as run_join

    token = chosen_token(token)
    run_join(_settings(), url=url, token=token, slots=slots, benchmark=not no_benchmark,
             rebenchmark=rebenchmark,
             save=not no_save, ready_fd=ready_fd, prefetch=prefetch, max_slots=max_slots,
             exit_with_parent=exit_with_parent, pass_env=pass_env)


def _client(url: str | None, token: str | None,
            output: Callable[[str, str, bytes, str], None] | None = None) -> GPUMesh:
    from ..client import GPUMesh

    token = chosen_token(token)
    try:
        return GPUMesh(url, token, quiet=True, settings=_settings(), output=output)
    except MeshError as exc:
        fail(str(exc))


def _connection(fn: _F) -> _F:
    fn = token_options(envvar=False, what="(default: GPUMESH_TOKEN, then the saved one)")(fn)
    return click.option("--url", default=None,
                        help="Coordinator URL (or GPUMESH_URL, or the saved one).")(fn)


def _with_client(url: str | None, token: str | None, work: Callable[[GPUMesh], _T],
                 output: Callable[[str, str, bytes, str], None] | None = None) -> _T:
    """Run ``work(client)``; a MeshError becomes a one-line error and exit status 1."""
    client = _client(url, token, output)
    try:
        return work(client)
    except MeshError as exc:
        fail(str(exc))
    finally:
        client.close()


@cli.command()
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.option("--payloads", "payloads_file", required=True, type=click.Path(dir_okay=False),
              help="JSON file with a list of payloads: one task each, given to the script on stdin.")
@click.option("--name", default=None, help="Job name shown by 'status' (default: the script path).")
@click.option("--wait", is_flag=True, help="Show progress until the job ends, then every result.")
@click.option("--timeout", type=_Seconds(0.001, YEAR), default=None,
              help="Seconds each task may run before it is stopped.")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Runs per task when workers die under it (a script error is not retried).")
@click.option("--priority", type=int, default=0, show_default=True,
              help="Higher runs first.")
@click.option("--env", "env", multiple=True, metavar="NAME",
              help="Send this shell's value of variable NAME with each task (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for use from other programs).")
@_connection
def submit(script: str, payloads_file: str, name: str | None, wait: bool, timeout: float | None,
           max_attempts: int, priority: int, env: tuple[str, ...], as_json: bool,
           url: str | None, token: str | None) -> None:
    """Run SCRIPT once per payload, across the mesh.

    Each payload object reaches the script as JSON on stdin; what the script prints on stdout
    is its result. The keys gpu, cores, memory, vram and cost are read by the scheduler
    instead (see docs/protocol.md). With --wait the exit status is 1 if any task failed.

    \b
    Example:
      gpumesh submit examples/grid_search.py --payloads examples/payloads.json --wait
    """
    from ..client.tasks import TaskOptions
    from . import jobs

    try:
        options = TaskOptions(timeout=timeout, max_attempts=max_attempts, priority=priority,
                              env=env)
    except MeshError as exc:
        fail(str(exc))
    unset = [name for name in env if name not in os.environ]
    if unset:
        one = len(unset) == 1
        fail(f"--env {' '.join(unset)}: {'it is' if one else 'they are'} not set in this shell; "
             f"--env sends this shell's value: set {'it' if one else 'them'} first "
             f"(export {unset[0]}=VALUE), then submit")
    # With --wait, what the scripts write on stderr (their logs) streams here, above the bar.
    board = jobs.Board(tty=False if as_json else None)
    sys.exit(_with_client(url, token, lambda c: jobs.submit(
        c, script, payloads_file, name, wait, as_json, options, board),
        output=board.output if wait else None))


@cli.command()
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for use from other programs).")
@_connection
def status(job: str | None, as_json: bool, url: str | None, token: str | None) -> None:
    """Show one job (by id, id prefix or name), or the mesh and its recent jobs.

    \b
    Examples:
      gpumesh status
      gpumesh status c3f81cc498f0
      gpumesh status c3f8 --json
    """
    from . import jobs

    _with_client(url, token, lambda c: jobs.status(c, job, as_json))


@cli.command()
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for use from other programs).")
@_connection
def results(job: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Print a script job's outputs whole (status shows each only up to 4 KiB).

    A detached submit's results stay readable for GPUMESH_RESULT_TTL (24 h); those its
    submitter already collected (submit --wait) are no longer held.

    \b
    Examples:
      gpumesh results c3f81cc498f0
      gpumesh results grid --json > results.json
    """
    from . import jobs

    _with_client(url, token, lambda c: jobs.results(c, job, as_json))


_FORCE = click.option(
    "--force", is_flag=True,
    help="Act on a job another account or machine submitted (refused without it).")


@cli.command()
@click.argument("job")
@_FORCE
@_connection
def cancel(job: str, force: bool, url: str | None, token: str | None) -> None:
    """Cancel a job: pending tasks never start, running ones are stopped.

    You may cancel the jobs submitted from your account on this machine (user@host);
    another owner's job needs --force.

    \b
    Example:
      gpumesh cancel c3f81cc498f0
    """
    from . import jobs

    sys.exit(_with_client(url, token, lambda c: jobs.control(c, "cancel", job, force=force)))


@cli.command()
@click.argument("job")
@click.option("--wait", is_flag=True, help="Show progress until the re-run ends.")
@_FORCE
@_connection
def retry(job: str, wait: bool, force: bool, url: str | None, token: str | None) -> None:
    """Run a job's failed and cancelled tasks again.

    Each task runs as it was submitted: the same script and payload. To run an edited script,
    submit it again. Another owner's job needs --force.

    \b
    Example:
      gpumesh retry c3f81cc498f0 --wait
    """
    from . import jobs

    sys.exit(_with_client(url, token, lambda c: jobs.control(c, "retry", job, wait, force)))


@cli.command()
@click.argument("worker")
@_connection
def kill(worker: str, url: str | None, token: str | None) -> None:
    """Remove a worker (id, id prefix or hostname) from the mesh.

    Its running tasks go back to the queue and run elsewhere; the worker process exits.
    Any client of the mesh may remove any worker; the worker's owner is told who did.

    \b
    Example:
      gpumesh kill 0afecb2dfd44
    """
    from . import jobs

    sys.exit(_with_client(url, token, lambda c: jobs.control(c, "kill", worker)))


@cli.command()
@_dashboard_options
@click.option("--exit-with-parent", is_flag=True, hidden=True)
@_connection
def dashboard(dashboard_host: str, dashboard_port: int, dashboard_cert: str | None,
              dashboard_key: str | None, exit_with_parent: bool,
              url: str | None, token: str | None) -> None:
    """Serve a live web page of the mesh: workers and their GPU/CPU use, jobs, failures,
    throughput and latency, the coordinator's health.

    Bound to loopback by default (plain HTTP), where it opens from the link it prints to the
    terminal (a random key, new each start) or with the mesh token at its login page: every
    account on the machine reaches 127.0.0.1. Bound to another address, the page is HTTPS
    (--dashboard-cert/--dashboard-key, or a self-signed certificate made with openssl, whose
    fingerprint is printed) and asks for the mesh token before it shows anything. Cancel and
    drain from the page act as this machine's user@host.

    \b
    Examples:
      gpumesh dashboard                               # http://127.0.0.1:8265/?key=...
      gpumesh dashboard --url tcp://192.0.2.10:8000 --token-file mesh.token
      gpumesh dashboard --dashboard-host 0.0.0.0      # HTTPS; others log in with the token
      ssh -L 8265:127.0.0.1:8265 HOST                 # or keep it on loopback, reach it so
    """
    from .dashboard import run as run_dashboard

    run_dashboard(_settings(), url=url, token=chosen_token(token), host=dashboard_host,
                  port=dashboard_port, cert=dashboard_cert, key=dashboard_key,
                  exit_with_parent=exit_with_parent)


@cli.command()
@click.option("--timeout", type=_Seconds(0.5, 60), default=3.0, show_default=True,
              help="Seconds to listen for answers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for use from other programs).")
@token_options(envvar=False, what="(default: GPUMESH_TOKEN, then the saved one): marks its mesh")
def discover(timeout: float, as_json: bool, token: str | None) -> None:
    """List the gpumesh coordinators advertised on the LAN (zeroconf).

    Only coordinators bound beyond loopback advertise themselves. The list is a hint: joining
    still needs the mesh's token, which nothing here reveals.

    \b
    Example:
      gpumesh discover
      gpumesh discover --json --timeout 5
    """
    from .discover import discover as run_discover

    settings = _settings()
    token = chosen_token(token) or settings.token
    if token is None:
        try:
            saved = settings.saved_connection()
        except MeshError:
            saved = None
        token = saved.token if saved else None
    run_discover(settings, token, timeout, as_json)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for use from other programs).")
@_connection
def devices(as_json: bool, url: str | None, token: str | None) -> None:
    """Show the unified pool: every GPU, and every CPU-only worker, of the mesh.

    \b
    Example:
      gpumesh devices
      gpumesh devices --json
    """
    from . import jobs

    def show(client: GPUMesh) -> None:
        pool, listing = client.devices(), client.workers()
        if as_json:
            click.echo(json_text(pool))
        else:
            click.echo(jobs.devices_table(pool, listing))

    _with_client(url, token, show)


@cli.command()
@click.option("--worker", default=None, help="Only this worker (id or id prefix); default: all here.")
def pause(worker: str | None) -> None:
    """Stop this machine's workers taking new tasks; running ones finish.

    Queued tasks are handed back to the mesh at once. Run on the worker's machine.

    \b
    Example:
      gpumesh pause
    """
    from .owner import steer

    sys.exit(steer(_settings(), "pause", worker, wait=False))


@cli.command()
@click.option("--worker", default=None, help="Only this worker (id or id prefix); default: all here.")
def resume(worker: str | None) -> None:
    """Let this machine's paused workers take tasks again. Run on the worker's machine.

    \b
    Example:
      gpumesh resume
    """
    from .owner import steer

    sys.exit(steer(_settings(), "resume", worker, wait=False))


@cli.command()
@click.option("--worker", default=None, help="Only this worker (id or id prefix); default: all here.")
@click.option("--now", "at_once", is_flag=True,
              help="Hand running tasks back too (they rerun elsewhere) and leave at once.")
@click.option("--wait", is_flag=True, help="Return only once the workers have left.")
def drain(worker: str | None, at_once: bool, wait: bool) -> None:
    """Take this machine out of the mesh without losing anyone's work.

    Nothing new starts; running tasks finish (or, with --now, go back to the queue), then each
    worker here leaves. Run on the worker's machine.

    \b
    Example:
      gpumesh drain --wait
    """
    from .owner import steer

    sys.exit(steer(_settings(), "drain-now" if at_once else "drain", worker, wait))


@cli.command()
@_connection
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for use from other programs).")
def workers(url: str | None, token: str | None, as_json: bool) -> None:
    """List the workers of the mesh.

    \b
    Example:
      gpumesh workers
      gpumesh workers --url tcp://192.0.2.10:8000 --json
    """
    listing = _with_client(url, token, lambda c: c.workers())
    if as_json:
        click.echo(json_text(listing))
    else:
        click.echo(worker_table(listing))


@cli.command()
@click.option("--json", "as_json", is_flag=True,
              help="The same report as one JSON document on stdout (warnings on stderr).")
@click.option("--timeout", type=_Seconds(0.5, 60), default=3.0, show_default=True,
              help="Seconds to wait for the coordinator to answer.")
@_connection
def doctor(as_json: bool, timeout: float, url: str | None, token: str | None) -> None:
    """Check this machine and its mesh; change nothing, never show the token.

    Reports which gpumesh is imported and from where, Python, torch/CUDA (and whether
    nvidia-smi disagrees), cloudpickle, the saved coordinator and whether it answers, its
    workers (flagging other Python, gpumesh or cloudpickle versions), the addresses serve
    would bind and advertise, the Windows firewall rule, and shared memory (/dev/shm's room,
    and what gpumesh's frames hold there). Exits 1 only for a fault on this machine: no
    coordinator, or one that does not answer, is a warning.

    \b
    Example:
      gpumesh doctor
      gpumesh doctor --json > report.json
    """
    from .doctor import run as run_doctor

    sys.exit(run_doctor(as_json=as_json, url=url, token=chosen_token(token), timeout=timeout))


@cli.command()
def setup() -> None:
    """Set up this machine by answering a few questions (needs the ui extra).

    Asks whether this machine starts a coordinator, joins a mesh as a worker or only uses
    one from Python; makes or takes the token (never shown); for a worker, finds the mesh's
    coordinator on the LAN or takes its address. After a summary and your yes, it saves what
    'serve' or 'join' would save, and prints the command to run next. Ctrl+C saves nothing.

    \b
    Example:
      pip install "gpumesh[ui]"
      gpumesh setup
    """
    from .setup import run as run_setup

    run_setup(_settings())


@cli.command()
@click.option("--file", "path", type=click.Path(dir_okay=False), default=None,
              help="Write it to this new file, readable only by you, instead of printing it.")
def token(path: str | None) -> None:
    """Make a new mesh token: SALT.SECRET, a random salt and a 192-bit secret.

    \b
    Examples:
      gpumesh token --file mesh.token      # then: gpumesh serve --token-file mesh.token
      export GPUMESH_TOKEN=$(gpumesh token)
    """
    from ..tokens import new_token, write_token_file

    if path is None:
        click.echo(new_token())
        return
    try:
        write_token_file(path, new_token())
    except FileExistsError:
        fail(f"{path} exists already: pick a new file (a token is never overwritten)")
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror}")
    click.echo(f"[gpumesh] new token written to {path} (mode 0600)", err=True)


@cli.command()
@click.option("--workers", "worker_count", default=2, show_default=True,
              type=click.IntRange(0, 16), help="Workers to join besides the self-worker.")
@click.option("--tasks", default=12, show_default=True, type=click.IntRange(1, 10_000),
              help="Tasks in the demo's .map.")
def demo(worker_count: int, tasks: int) -> None:
    """Start a throwaway mesh on this machine, run a .map through it, show what ran where.

    \b
    Example:
      gpumesh demo --workers 2 --tasks 12
    """
    from .demo import run_demo

    sys.exit(run_demo(worker_count, tasks))


def main() -> None:
    cli(prog_name="gpumesh")
