"""Tiny-task throughput and round-trip latency: gpumesh next to the alternatives, in one run.

    python bench/tiny_tasks.py [--tasks 5000] [--workers 2]

Measures, on this machine: a bare pyzmq ROUTER broker with DEALER workers (the fabric's floor),
multiprocessing.Pool (chunksize=1), gpumesh (.map of no-op tasks, and one-at-a-time round
trips), and Dask / Ray when they are installed. Prints tasks/s, p50 round trip, and gpumesh's
ratio to each. Never asserts anything: numbers are for reading, not for CI.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time

import zmq

PREFETCH = 0


def noop(x: int) -> int:
    return x


def bare_broker(tasks: int, workers: int) -> tuple[float, float]:
    """A minimal ROUTER broker forwarding to DEALER workers in threads: the floor to compare to."""
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    port = front.bind_to_random_port("tcp://127.0.0.1")
    back = ctx.socket(zmq.ROUTER)
    back_port = back.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def worker() -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{back_port}")
        sock.send(b"READY")
        while not stop.is_set():
            if sock.poll(100):
                client, body = sock.recv_multipart()
                sock.send_multipart([client, body])
        sock.close(0)

    def broker() -> None:
        idle: list[bytes] = []
        queue: list[list[bytes]] = []
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        while not stop.is_set():
            for sock, _ in poller.poll(100):
                if sock is back:
                    wid, *rest = back.recv_multipart()
                    idle.append(wid)
                    if rest != [b"READY"]:
                        front.send_multipart(rest)
                else:
                    queue.append(front.recv_multipart())
            while idle and queue:
                back.send_multipart([idle.pop(0), *queue.pop(0)])

    threads = [threading.Thread(target=worker) for _ in range(workers)] + [threading.Thread(target=broker)]
    for t in threads:
        t.start()
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)
    rtts = []
    for i in range(200):
        start = time.perf_counter()
        client.send(str(i).encode())
        client.recv()
        rtts.append(time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(tasks):
        client.send(str(i).encode())
    for _ in range(tasks):
        client.recv()
    rate = tasks / (time.perf_counter() - start)
    stop.set()
    for t in threads:
        t.join()
    for sock in (client, front, back):
        sock.close(0)
    ctx.term()
    return rate, statistics.median(rtts)


def pool(tasks: int, workers: int) -> tuple[float, float]:
    with multiprocessing.Pool(workers) as p:
        rtts = []
        for i in range(200):
            start = time.perf_counter()
            p.apply(noop, (i,))
            rtts.append(time.perf_counter() - start)
        start = time.perf_counter()
        p.map(noop, range(tasks), chunksize=1)
        return tasks / (time.perf_counter() - start), statistics.median(rtts)


def gpumesh_mesh(tasks: int, workers: int) -> tuple[float, float]:
    from gpumesh import GPUMesh
    from gpumesh.config import Settings

    with tempfile.TemporaryDirectory() as home:
        token = secrets.token_urlsafe(32)
        env = {"GPUMESH_HOME": home}
        coordinator = GPUMesh.start_coordinator(port=0, token=token, self_worker=False, home=home,
                                                env=env)
        handles = [coordinator] + [GPUMesh.add_worker(coordinator.url, token=token, slots=1,
                                                      home=home, env=env, extra_args=["--prefetch", str(PREFETCH)])
                                   for _ in range(workers)]
        try:
            settings = Settings.from_env({**os.environ, **env})
            with GPUMesh(coordinator.url, token, quiet=True, settings=settings) as mesh:
                mesh.map(noop, range(100))  # warm the runners
                rtts = []
                for i in range(200):
                    start = time.perf_counter()
                    mesh.submit(noop, i).result()
                    rtts.append(time.perf_counter() - start)
                start = time.perf_counter()
                mesh.map(noop, range(tasks))
                return tasks / (time.perf_counter() - start), statistics.median(rtts)
        finally:
            for handle in handles:
                handle.stop()


def dask_local(tasks: int, workers: int) -> tuple[float, float]:
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True) as cluster, \
            Client(cluster) as client:
        rtts = []
        for i in range(50):
            start = time.perf_counter()
            client.submit(noop, i, pure=False).result()
            rtts.append(time.perf_counter() - start)
        start = time.perf_counter()
        client.gather(client.map(noop, range(tasks), pure=False))
        return tasks / (time.perf_counter() - start), statistics.median(rtts)


def ray_local(tasks: int, workers: int) -> tuple[float, float]:
    import ray

    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(noop)
        rtts = []
        for i in range(50):
            start = time.perf_counter()
            ray.get(remote.remote(i))
            rtts.append(time.perf_counter() - start)
        start = time.perf_counter()
        ray.get([remote.remote(i) for i in range(tasks)])
        return tasks / (time.perf_counter() - start), statistics.median(rtts)
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=0, help="gpumesh workers' --prefetch")
    args = parser.parse_args()
    global PREFETCH
    PREFETCH = args.prefetch
    runs = {"bare pyzmq broker": bare_broker, "multiprocessing.Pool": pool, "gpumesh": gpumesh_mesh,
            "dask (LocalCluster)": dask_local, "ray": ray_local}
    results: dict[str, tuple[float, float]] = {}
    for name, fn in runs.items():
        try:
            results[name] = fn(args.tasks, args.workers)
        except ImportError:
            print(f"{name:<22} not installed, skipped", file=sys.stderr)
    mine = results["gpumesh"]
    print(f"\n{args.tasks} no-op tasks, {args.workers} workers, {os.cpu_count()} cores\n")
    print(f"{'system':<22}{'tasks/s':>10}{'p50 rtt ms':>12}{'gpumesh rate ratio':>20}")
    for name, (rate, rtt) in results.items():
        print(f"{name:<22}{rate:>10.0f}{rtt * 1000:>12.2f}{mine[0] / rate:>20.2f}")


if __name__ == "__main__":
    main()
