"""bench/procs.py's CPU reading of other processes: the figures of the CPU tables."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.procs import _proc_stat_cpu, cpu_seconds


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and process CPU clocks")
def test_another_processs_cpu_is_read_finer_than_the_kernels_ticks_and_agrees_with_them():
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n" \
           "print('spun', flush=True)\ntime.sleep(30)"
    with subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE,
                          text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "spun\n"
            precise, ticks = cpu_seconds(child.pid), _proc_stat_cpu(child.pid)
            assert precise is not None and ticks is not None
            assert 0.3 <= precise < 5.0
            assert abs(precise - ticks) < 0.05  # the same CPU, one in 10 ms steps
            assert precise != round(precise, 2)  # not ticks: a 10 ms step would be exact
        finally:
            child.kill()
            child.wait(10)  # reaped
    assert cpu_seconds(child.pid) is None  # reaped: gone, not a stale or made-up figure
