"""The app image (``astraflow:dev``) built from the index against built from the wheelhouse.

``index``
    ``scripts/offline-images app`` with no wheelhouse: pip inside the build downloads every
    dependency (torch and its CUDA libraries included) from the package index, as a plain
    ``docker build`` does.
``wheelhouse``
    the same build with a wheelhouse made first by ``scripts/offline-images wheels`` (into
    a fresh directory; ``wheels_s`` is that download) served on the loopback: pip installs
    from it with no index.

Before each build the engine's build cache is dropped (``docker builder prune -af``) and the
image removed, so every layer is built; the base image is kept. In CI the wheelhouse is
made once and serves the host's install too (``.ci/run``), so torch crosses the network
once. Wall-clock seconds of this machine, one run: compare only numbers from the same run.

Run: ``python bench/image_build.py --out bench/results/image_build.json`` (needs a Docker
engine and the base image, ``bash scripts/offline-images base``; 3 GB of disk for the
wheels; about 6 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

REPO = Path(__file__).resolve().parents[1]
IMAGE = "astraflow-bench:image-build"


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def build(wheels: Path) -> dict[str, float]:
    """One build of the app image from scratch with ``wheels`` as the wheelhouse (an empty
    directory: the index): seconds and image size in MB."""
    subprocess.run(["docker", "image", "rm", "-f", IMAGE], capture_output=True)
    _docker("builder", "prune", "-af")
    env = {**os.environ, "FORCE": "1", "ASTRAFLOW_IMAGE": IMAGE,
           "ASTRAFLOW_WHEELS": str(wheels)}
    t0 = time.monotonic()
    subprocess.run(["bash", "scripts/offline-images", "app"], cwd=REPO, env=env, check=True)
    seconds = time.monotonic() - t0
    size = int(_docker("image", "inspect", "-f", "{{.Size}}", IMAGE)) / 1e6
    subprocess.run(["docker", "image", "rm", "-f", IMAGE], capture_output=True)
    return {"build_s": round(seconds, 1), "size_mb": round(size)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        empty, wheels = Path(tmp, "empty"), Path(tmp, "wheels")
        empty.mkdir()
        runs = {"index": build(empty)}
        t0 = time.monotonic()
        subprocess.run(["bash", "scripts/offline-images", "wheels"], cwd=REPO, check=True,
                       env={**os.environ, "ASTRAFLOW_WHEELS": str(wheels)})
        wheels_s = time.monotonic() - t0
        runs["wheelhouse"] = build(wheels)
        wheel_files = list(wheels.glob("*.whl"))
        result = {
            "wheels_s": round(wheels_s, 1),
            "wheelhouse_files": len(wheel_files),
            "wheelhouse_mb": round(sum(f.stat().st_size for f in wheel_files) / 1e6),
            "builds": runs,
        }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": run_meta("image_build", ["python", *sys.argv]), **result}, f,
                      indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
