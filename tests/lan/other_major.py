"""``python other_major.py ARGS``: the gpumesh CLI as a release of another protocol major runs it.

For the LAN test of a worker that meets a coordinator of another major: this process speaks
protocol ``FAKE_MAJOR`` on the wire (every signature it sends, every HELLO it checks), advertises
it in its TXT record, and calls itself gpumesh ``FAKE_VERSION``. Nothing else differs, so what a
worker sees is what a real mismatched release would show it.
"""

from __future__ import annotations

import sys

FAKE_MAJOR = 2
FAKE_VERSION = "2.0.0"


def _sweep(real_major: int, real_version: str) -> None:
    """Every gpumesh module holding the real major or version (copied at import) gets the fake."""
    for module in [m for name, m in sys.modules.items() if name.split(".")[0] == "gpumesh"]:
        if getattr(module, "MAJOR", None) == real_major:
            module.MAJOR = FAKE_MAJOR
        if getattr(module, "__version__", None) == real_version:
            module.__version__ = FAKE_VERSION


def main() -> None:
    from gpumesh import _version
    from gpumesh.protocol import messages

    real_major, real_version = messages.MAJOR, _version.__version__
    assert real_major != FAKE_MAJOR and real_version != FAKE_VERSION
    messages.SIGNATURE = messages.MAGIC + bytes([FAKE_MAJOR])
    _sweep(real_major, real_version)  # modules imported from here on copy the fake
    from gpumesh.cli import main as cli
    from gpumesh.cli import serve  # noqa: F401  (imported here, swept below)
    from gpumesh.coordinator import broker, server  # noqa: F401

    _sweep(real_major, real_version)
    from gpumesh import discovery

    assert discovery.txt_record("0" * 12)["proto"] == str(FAKE_MAJOR)
    assert discovery.txt_record("0" * 12)["ver"] == FAKE_VERSION
    cli.main()


if __name__ == "__main__":
    main()
