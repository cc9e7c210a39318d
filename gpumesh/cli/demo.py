"""``gpumesh demo``: a whole mesh on loopback, in temporary state, through the real fabric."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections import Counter

import click

from ..client import GPUMesh
from ..client.launch import ProcessHandle, start_coordinator, start_worker
from ..config import Settings, new_token
from ..errors import MeshError
from ..worker.runners import why_no_runners


def monte_carlo_pi(seed: int, samples: int) -> dict[str, object]:
    """The demo's task: a slice of a Monte Carlo estimate of pi, and where it ran."""
    import random

    rng = random.Random(seed)
    inside = sum(1 for _ in range(samples) if rng.random() ** 2 + rng.random() ** 2 <= 1.0)
    return {"seed": seed, "inside": inside, "samples": samples, "pid": os.getpid(),
            "host": socket.gethostname()}


def run_demo(worker_count: int, tasks: int) -> int:
    unable = why_no_runners()
    if unable is not None:
        click.echo(f"error: the demo runs workers on this machine, and {unable}", err=True)
        return 1
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gpumesh-demo-") as home:
        token = new_token()
        env = {"GPUMESH_HOME": home}
        click.echo("[demo] starting a coordinator on 127.0.0.1 (temporary state, random port) ...")
        coordinator = start_coordinator(port=0, token=token, home=home, slots=1, env=env)
        handles: list[ProcessHandle] = [coordinator]
        try:
            click.echo(f"[demo] coordinator up at {coordinator.url}; self-worker joining")
            for index in range(worker_count):
                worker = start_worker(coordinator.url, token=token, slots=1, home=home, env=env)
                handles.append(worker)
                click.echo(f"[demo] worker {index + 1}/{worker_count} joined as {worker.worker_id}")
            settings = Settings.from_env({**os.environ, **env})
            with GPUMesh(coordinator.url, token, quiet=True, settings=settings) as mesh:
                expected = worker_count + 1
                deadline = time.time() + 30
                while time.time() < deadline:
                    alive = [w for w in mesh.workers() if w["alive"]]
                    if len(alive) >= expected:
                        break
                    time.sleep(0.1)
                names = {w["id"]: w["hostname"] for w in mesh.workers()}
                click.echo(f"[demo] {len(names)} workers in the pool; running .map of {tasks} "
                           "tasks ...")
                calls = [((), {"seed": seed, "samples": 200_000}) for seed in range(tasks)]
                futures = mesh.submit_calls(monte_carlo_pi, calls)
                results = mesh.gather(futures)
                click.echo("")
                click.echo("  task  worker    pid      inside/samples")
                for future, result in zip(futures, results, strict=True):
                    click.echo(f"  {result['seed']:>4}  {future.worker[:8]:<9} {result['pid']:<8} "
                               f"{result['inside']}/{result['samples']}")
                inside = sum(r["inside"] for r in results)
                total = sum(r["samples"] for r in results)
                local = [monte_carlo_pi(seed, 200_000)["inside"] for seed in range(min(tasks, 2))]
                same = all(results[i]["inside"] == local[i] for i in range(len(local)))
                per_worker = Counter(f.worker[:8] for f in futures)
                click.echo("")
                click.echo(f"  pi ~= {4 * inside / total:.5f} from {total:,} samples")
                click.echo("  ran on: " + ", ".join(f"{w} ({n} task{'s' * (n != 1)})" for w, n in
                                                      sorted(per_worker.items())))
                click.echo(f"  remote results equal local ones: {'yes' if same else 'NO'}")
        except MeshError as exc:
            click.echo(f"error: the demo failed: {exc}", err=True)
            return 1
        finally:
            click.echo("[demo] tearing down ...")
            for handle in reversed(handles):
                handle.stop()
    click.echo(f"[demo] done in {time.time() - started:.1f}s; nothing left running")
    return 0 if same else 1
