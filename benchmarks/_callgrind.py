"""Instruction counts per phase of a Python script run under callgrind (immune to machine load).

The profiled script marks the boundaries of its phases with ``os.getppid()``: callgrind is told
to dump its counters before every call of it (``--dump-before=getppid``), so one run yields one
count per stretch between two marks, whatever else the machine is doing.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def callgrind_dump_totals(script: Sequence[str], directory: Path) -> list[int]:
    """Run ``script`` (a Python file and its arguments) under callgrind, its dumps written into
    ``directory``; return the instruction total of the dump taken at every mark, in order:
    entry k counts what ran between mark k - 1 (or the start) and mark k. What runs after the
    last mark is not returned. Raises CalledProcessError when the script fails."""
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--dump-before=getppid",
            f"--callgrind-out-file={directory / 'callgrind.out'}",
            sys.executable,
            *script,
        ],
        check=True,
        capture_output=True,
    )
    dumps = sorted(directory.glob("callgrind.out.*"), key=lambda path: int(path.suffix[1:]))
    totals: list[int] = []
    for dump in dumps:
        for line in dump.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                totals.append(int(line.split()[1]))
                break
    return totals
