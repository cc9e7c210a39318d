"""A data-preprocessing job as a script task: each payload names a slice of a CSV file; the
script cleans it (drops rows with missing values, normalises the numeric column) and prints a
summary as JSON. Run it over a file cut into slices:

    gpumesh submit examples/preprocess.py --payloads examples/preprocess_payloads.json --wait

The CSV must be readable at the same path on every worker (a shared folder), or be small
enough to travel inside the payload (``rows``) as here.
"""

import csv
import io
import json
import statistics
import sys

payload = json.load(sys.stdin)
rows = list(csv.DictReader(io.StringIO(payload["rows"])))
clean = [r for r in rows if r.get("value", "").strip() and r.get("city", "").strip()]
values = [float(r["value"]) for r in clean]
mean = statistics.fmean(values) if values else 0.0
spread = statistics.pstdev(values) if len(values) > 1 else 1.0
by_city: dict[str, int] = {}
for r in clean:
    by_city[r["city"]] = by_city.get(r["city"], 0) + 1
print(json.dumps({"part": payload["part"], "rows": len(rows), "kept": len(clean),
                  "mean": round(mean, 3),
                  "normalised": [round((v - mean) / (spread or 1.0), 3) for v in values],
                  "by_city": by_city}))
