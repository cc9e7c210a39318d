"""gpumesh's benchmark suite: gpumesh next to the alternatives, in one run on one machine.

Run it with ``python -m bench`` (``--quick`` for about a minute). Nothing here is imported by
the gpumesh package or its tests, and nothing here asserts a speed: the numbers are for reading.
"""
