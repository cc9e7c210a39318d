"""The Python API: start a coordinator and two workers from Python, distribute, inspect, stop."""

from gpumesh import GPUMesh


def train(lr, epochs):
    return {"lr": lr, "loss": round(1 / (lr * epochs), 4)}


if __name__ == "__main__":
    # port 0: any free port; binds 127.0.0.1. No worker of its own: the two below are the mesh.
    coordinator = GPUMesh.start_coordinator(port=0, self_worker=False)
    workers = [GPUMesh.add_worker(coordinator.url, token=coordinator.token) for _ in range(2)]
    try:
        with GPUMesh(coordinator.url, token=coordinator.token) as mesh:
            results = mesh.distribute(
                function=train,
                params=[{"lr": 0.01, "epochs": 100}, {"lr": 0.05, "epochs": 200}],
                timeout=60,
            )
            print(results)
            for worker in mesh.workers():
                print(worker["id"][:8], worker["hostname"], worker["device"], worker["alive"])
    finally:
        for handle in [*workers, coordinator]:
            handle.stop()
