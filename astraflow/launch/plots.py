"""A run's figures from its ``summary.json``: held-out accuracy and train reward over time
and over versions, staleness and lag over time (``astraflow run plot RUN``; ``up`` draws
them when it ends)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _series(summary: dict[str, Any], key: str, x: str = "t") -> list[tuple[float, float]]:
    return [(s[x], s[key]) for s in summary.get("series", [])
            if s.get(key) is not None and s.get(x) is not None and s[key] == s[key]]


def write_plots(summary: dict[str, Any], run_dir: Path) -> list[Path]:
    """Write ``run_dir/summary.png`` (accuracy and reward over time) and
    ``run_dir/plots/{versions,staleness,lag}.png``; the files written ([] without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    (run_dir / "plots").mkdir(parents=True, exist_ok=True)
    policies = sorted(set(summary.get("versions", {})) | set(summary.get("eval", {})))
    out = []
    for name, draw in (("summary.png", _over_time), ("plots/versions.png", _over_versions),
                       ("plots/staleness.png", _staleness), ("plots/lag.png", _lag)):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        draw(ax, summary, policies)
        ax.set_title(f"AstraFlow run {summary.get('run', '?')}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.savefig(run_dir / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        out.append(run_dir / name)
    return out


def _over_time(ax, summary: dict[str, Any], policies: list[str]) -> None:
    _accuracy_and_reward(ax, summary, policies, "t", "t")
    ax.set_xlabel("seconds")


def _over_versions(ax, summary: dict[str, Any], policies: list[str]) -> None:
    _accuracy_and_reward(ax, summary, policies, "version/{p}", "version")
    ax.set_xlabel("weight version")


def _accuracy_and_reward(ax, summary: dict[str, Any], policies: list[str], series_x: str,
                         eval_x: str) -> None:
    for p in policies:
        pts = _series(summary, f"reward/{p}", series_x.format(p=p))
        if pts:
            ax.plot(*zip(*pts), label=f"{p} train reward")
        ev = summary.get("eval", {}).get(p, [])
        if ev:
            ax.plot([e[eval_x] for e in ev], [e["accuracy"] for e in ev], "o-",
                    label=f"{p} held-out accuracy")
    ax.set_ylim(0, 1)


def _staleness(ax, summary: dict[str, Any], policies: list[str]) -> None:
    for p in policies:
        pts = _series(summary, f"staleness_mean/{p}")
        if pts:
            ax.plot(*zip(*pts), label=f"{p} mean staleness of trained tokens (versions)")
    pts = _series(summary, "stale_dropped")
    if pts:
        ax.plot(*zip(*pts), label="groups dropped as stale (total)")
    ax.set_xlabel("seconds")


def _lag(ax, summary: dict[str, Any], policies: list[str]) -> None:
    pts = _series(summary, "lag/tasks")
    if pts:
        ax.plot(*zip(*pts), label="tasks not yet taken by RaaS")
    ax.set_xlabel("seconds")
    ax.set_ylabel("records")
