"""A script task: reads its payload as JSON on stdin, prints its result as JSON on stdout.

Fits a tiny logistic regression with plain Python so it runs on any worker.
"""

import json
import math
import random
import sys

payload = json.load(sys.stdin)
lr, epochs, l2 = payload["lr"], payload["epochs"], payload.get("l2", 0.0)

rng = random.Random(0)
data = [(rng.gauss(0, 1), rng.gauss(0, 1)) for _ in range(400)]
labels = [1.0 if x - 1.3 * y > 0 else 0.0 for x, y in data]
w = [0.0, 0.0, 0.0]
for _ in range(epochs):
    grad = [0.0, 0.0, 0.0]
    for (x, y), t in zip(data, labels):
        p = 1 / (1 + math.exp(-(w[0] * x + w[1] * y + w[2])))
        for i, f in enumerate((x, y, 1.0)):
            grad[i] += (p - t) * f / len(data)
    w = [wi - lr * (gi + l2 * wi) for wi, gi in zip(w, grad)]
correct = sum((w[0] * x + w[1] * y + w[2] > 0) == (t == 1.0) for (x, y), t in zip(data, labels))
print(json.dumps({"lr": lr, "epochs": epochs, "l2": l2,
                  "val_accuracy": round(correct / len(data), 3),
                  "weights": [round(v, 4) for v in w]}))
