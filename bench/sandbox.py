"""How soon the code sandbox stops what it must stop: wall-clock seconds per kind of run.

tests/unit/sandbox/test_sandbox.py checks each stop by its mechanism (the limit that
fired, the reason and exit signal recorded), never by its time: on a shared, loaded
machine the time says more about the machine than about the sandbox. This measures it.
Each case runs ``--repeats`` times, round-robin (a slow spell of the machine hits every
case alike), with the sandbox's defaults unless the case sets a limit; the table gives per
case the status and reason every repeat ended with, and the median and largest wall-clock
``seconds`` and CPU seconds of the run.

    python bench/sandbox.py [--repeats 5] [--cases ok,cpu,wall,...] [--namespaces auto|on|off]
        [--out bench/results/sandbox.json]

Cases: ``ok`` (print and exit: the sandbox's own overhead), ``cpu`` (a busy loop at
``cpu_s`` 1: SIGXCPU), ``cpu-hard`` (one that ignores SIGXCPU: SIGKILL at the hard limit),
``wall`` (a sleep at ``timeout_s`` 1), ``memory`` (allocating until ``mem_mb`` 128),
``output`` (printing past ``max_output`` 10 000), ``fork`` (a fork bomb, the audit hook
refusing it), ``threads`` (a thread bomb at ``max_procs`` 8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

from astraflow.sandbox import SandboxResult, run_python  # noqa: E402

THREAD_BOMB = (
    "import threading\n"
    "stop = threading.Event()\n"
    "while True:\n"
    "    threading.Thread(target=stop.wait).start()\n"
)

# name -> (code, run_python limits); every case ends on its own well before timeout_s
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "ok": ("print(6 * 7)", {}),
    "cpu": ("while True:\n    pass", {"cpu_s": 1, "timeout_s": 120}),
    "cpu-hard": ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                 "while True:\n    pass", {"cpu_s": 1, "timeout_s": 120}),
    "wall": ("import time\ntime.sleep(600)", {"timeout_s": 1}),
    "memory": ("x = []\nwhile True:\n    x.append(bytearray(2 ** 20))",
               {"mem_mb": 128, "timeout_s": 120}),
    "output": ("while True:\n    print('x' * 1000)", {"max_output": 10_000, "timeout_s": 120}),
    "fork": ("import os\nwhile True:\n    os.fork()", {"timeout_s": 120}),
    "threads": (THREAD_BOMB, {"max_procs": 8, "mem_mb": 1024, "timeout_s": 120}),
}


@dataclass
class CaseRow:
    """One case's repeats: how each ended and its times."""

    name: str
    outcomes: list[str] = field(default_factory=list)  # "status/reason" per repeat
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)

    def add(self, r: SandboxResult) -> None:
        self.outcomes.append(f"{r.status}/{r.reason}" if r.reason else r.status)
        self.seconds.append(r.seconds)
        self.cpu_seconds.append(r.cpu_seconds)

    def summary(self) -> dict[str, Any]:
        """The row as the table and the JSON show it."""
        return {
            "case": self.name,
            "outcomes": sorted(set(self.outcomes)),
            "seconds_median": statistics.median(self.seconds),
            "seconds_max": max(self.seconds),
            "cpu_median": statistics.median(self.cpu_seconds),
            "repeats": len(self.seconds),
        }


def measure(names: list[str], repeats: int, namespaces: bool | None) -> list[CaseRow]:
    """Run each case in ``names`` ``repeats`` times, round-robin."""
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown} (known: {', '.join(CASES)})")
    if repeats < 1:
        raise ValueError("--repeats must be at least 1")
    rows = {n: CaseRow(n) for n in names}
    for _ in range(repeats):
        for name in names:
            code, limits = CASES[name]
            rows[name].add(run_python(code, namespaces=namespaces, **limits))
    return list(rows.values())


def report(rows: list[CaseRow]) -> str:
    """A plain-text table of ``rows``."""
    lines = [f"{'case':<9} {'median s':>9} {'max s':>8} {'cpu s':>7}  outcome"]
    for row in rows:
        s = row.summary()
        lines.append(f"{s['case']:<9} {s['seconds_median']:>9.3f} {s['seconds_max']:>8.3f} "
                     f"{s['cpu_median']:>7.3f}  {', '.join(s['outcomes'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--namespaces", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    meta = run_meta("sandbox", ["python", *sys.argv] if argv is None
                    else ["python", "bench/sandbox.py", *argv])
    namespaces = {"auto": None, "on": True, "off": False}[args.namespaces]
    try:
        rows = measure([c for c in args.cases.split(",") if c], args.repeats, namespaces)
    except ValueError as e:
        parser.error(str(e))
    print(report(rows))
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": [r.summary() for r in rows],
                                        "raw": [asdict(r) for r in rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
