"""A real PyTorch training step on the mesh: one small model per learning rate, each trained on
whichever worker is free (its GPU when it has one), the best one picked here.

    python examples/torch_train.py

Needs torch on every worker and here (`pip install torch`). With no mesh configured it runs
the same calls locally.
"""

from gpumesh import mesh


@mesh(timeout=600)
def train(lr: float, steps: int = 200, seed: int = 0) -> dict:
    import torch

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # A two-layer network learning y = sin(3x) from 512 noisy samples.
    x = torch.linspace(-1, 1, 512, device=device).unsqueeze(1)
    y = torch.sin(3 * x) + 0.05 * torch.randn_like(x)
    model = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return {"lr": lr, "loss": round(loss.item(), 5), "device": device}


if __name__ == "__main__":
    results = train.map([{"lr": lr} for lr in (0.001, 0.003, 0.01, 0.03)])
    for r in results:
        print(f"lr={r['lr']:<6} loss={r['loss']:<8} on {r['device']}")
    best = min(results, key=lambda r: r["loss"])
    print(f"best: lr={best['lr']} (loss {best['loss']})")
