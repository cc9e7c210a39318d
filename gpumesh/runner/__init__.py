"""Runner processes: where user code runs, apart from the worker agent's network loop."""
