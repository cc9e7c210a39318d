"""The README's quickstart: run after `gpumesh serve` (or with no mesh: it runs locally)."""

from gpumesh import mesh  # auto-connects using the saved config


@mesh
def train(lr, epochs):
    return {"lr": lr, "accuracy": round(0.90 + lr, 3)}


print(train(lr=0.01, epochs=100))  # one worker
print(train.map([{"lr": 0.01, "epochs": 100},  # every worker
                 {"lr": 0.05, "epochs": 200}]))
