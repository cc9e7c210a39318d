"""``python -m gpumesh``: the CLI."""

from .cli.main import main

main()
