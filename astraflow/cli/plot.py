"""``astraflow run plot`` (and its shortcut ``astraflow plot``): a run's figures as PNGs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from astraflow.launch.plots import write_plots

_EXAMPLES = ["astraflow run plot default", "astraflow plot default-2 --runs-dir runs"]


def register(subparsers: Any) -> None:
    from astraflow.cli.args import add_command, verbs_of

    for where, shortcut in ((verbs_of(subparsers, "run"), False), (subparsers, True)):
        p = add_command(where, "plot", help="shortcut of `run plot`" if shortcut else
                        "draw a run's accuracy, reward, staleness and lag into PNGs",
                        examples=_EXAMPLES)
        p.add_argument("name", metavar="RUN", help="the run (its directory under --runs-dir)")
        p.add_argument("--runs-dir", default="runs", help="where `up` wrote the run")
        p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    from astraflow.errors import AstraflowError

    run_dir = Path(args.runs_dir) / args.name
    path = run_dir / "summary.json"
    if not path.is_file():
        raise AstraflowError(f"plot: no {path}: `astraflow up` writes it when a run ends")
    files = write_plots(json.loads(path.read_text()), run_dir)
    if not files:
        raise AstraflowError("plot: needs matplotlib (python3 -m pip install matplotlib)")
    print("\n".join(str(f) for f in files))
    return 0
