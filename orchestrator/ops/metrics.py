"""`metrics RUN`: fetch a run's metrics (one agent call) and draw them: terminal (plotext) or PNG (matplotlib)."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.errors import AgentError, RunNotFound, UserError

# Series drawn, in panel order, with the keys the trainer may use for them.
PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("loss", ("loss",)),
    ("accuracy", ("acc", "accuracy")),
    ("simulated τ", ("sim_accept_len", "tau", "sim_tau")),
    ("tokens/s", ("tokens_per_s", "tok_per_s", "drafter_tokens_per_s")),
    ("memory MiB", ("mem_peak_mib", "mem_allocated_mib", "rss_mib", "mem_rss_mib")),
    ("recompiles", ("recompiles",)),
]


@dataclass
class MetricsSeries:
    run_id: str
    total_rows: int
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    """panel title -> (steps, values)"""


def fetch_metrics(target, run_id: str | None = None, *, experiment: str | None = None, max_rows: int = 2000) -> MetricsSeries:
    """Read runs/<run_id>/metrics.jsonl (or the newest run of `experiment`) in the target, in one agent
    call, into plottable series.

    Raises:
        RunNotFound: no such run in the target.
    """
    try:
        data = target.agent("metrics", {"run_id": run_id, "experiment": experiment, "max_rows": max_rows})
    except AgentError as exc:
        if exc.agent_type == "RunNotFound":
            raise RunNotFound(exc.message, fix=exc.fix) from None
        raise
    return series_from_rows(data["run_id"], data["rows"], data.get("total", len(data["rows"])))


def _number(v) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
        return float(sum(v) / len(v))  # per-slot accuracy: plot the mean
    return None


def series_from_rows(run_id: str, rows: list[dict], total: int | None = None) -> MetricsSeries:
    """Pick the known series out of metric rows; rows without a step use their index."""
    out = MetricsSeries(run_id, total if total is not None else len(rows))
    for title, keys in PANELS:
        xs, ys = [], []
        for i, row in enumerate(rows):
            for key in keys:
                if key in row:
                    v = _number(row[key])
                    if v is not None:
                        xs.append(float(row.get("step", i)))
                        ys.append(v)
                    break
        if xs:
            out.series[title] = (xs, ys)
    return out


def render_terminal(ms: MetricsSeries, width: int = 100, height: int = 12) -> str:
    """Draw each series as a small plotext chart (plain text, no colours); returns the text."""
    import plotext

    fig = plotext.figure
    parts = []
    for title, (xs, ys) in ms.series.items():
        fig.clear()
        fig.plot_size(width, height)
        fig.draw(fig.signal(xs, ys))
        fig.title(f"{ms.run_id}: {title}")
        fig.label("step")
        parts.append(plotext.uncolorize(str(fig.build())))
    return "\n".join(parts)


def write_png(ms: MetricsSeries, path: str) -> str:
    """Write all series as one PNG (a panel per series), atomically. Returns the path.

    Raises:
        UserError: matplotlib is not installed, or there is nothing to draw.
    """
    import os
    import tempfile

    if not ms.series:
        raise UserError(f"run {ms.run_id} has no metrics to draw yet")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--png needs matplotlib", fix="pip install matplotlib") from None
    n = len(ms.series)
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.2 * n), sharex=True, squeeze=False)
    for ax, (title, (xs, ys)) in zip(axes[:, 0], ms.series.items()):
        ax.plot(xs, ys, linewidth=1.2)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(f"dflashctl metrics: {ms.run_id}")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=".metrics-", suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
