"""`metrics RUN`: fetch a run's metrics (one agent call) and draw them: terminal (plotext) or PNG (matplotlib)."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.errors import UserError
from orchestrator.ops.runnotes import fetch_rows, run_notes
from trainer.metrics import parse_tau_key

# Series drawn, in panel order, with the keys the trainer may use for them (first key present wins).
PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("loss", ("loss",)),
    ("accuracy", ("acc", "accuracy")),
    ("simulated τ", ("sim_accept_len", "sim_tau")),
    ("tokens/s", ("tokens_per_s", "tok_per_s", "drafter_tokens_per_s")),
    ("memory MiB", ("mem_peak_mib", "mem_allocated_mib", "rss_mib", "mem_rss_mib")),
    ("recompiles", ("recompiles",)),
]
# The training loss's simulated τ is drawn in one panel with the real τ of the evaluations (greedy chain and
# DDTree budgets, keys named by trainer.metrics.tau_key; an older eval line's plain `tau` is the chain).
TAU_PANEL = "τ: simulated (training) and real (evaluation)"
MARKERS = "•x+o*#@%&"


@dataclass
class MetricsSeries:
    run_id: str
    total_rows: int
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    """series name -> (steps, values)"""
    panels: dict[str, list[str]] = field(default_factory=dict)
    """panel title -> the series drawn in it"""
    notes: list[str] = field(default_factory=list)
    """lines printed under the charts: the target/drafter balance, vLLM's verdict on the export"""


def fetch_metrics(target, run_id: str | None = None, *, experiment: str | None = None, max_rows: int = 2000) -> MetricsSeries:
    """Read runs/<run_id>/metrics.jsonl (or the newest run of `experiment`) in the target, in one agent
    call, into plottable series.

    Raises:
        RunNotFound: no such run in the target.
    """
    ans = fetch_rows(target, run_id, experiment=experiment, max_rows=max_rows)
    return series_from_rows(ans.run_id, ans.rows, ans.total)


def _number(v) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
        return float(sum(v) / len(v))  # per-slot accuracy: plot the mean
    return None


def _real_tau(rows: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Greedy real τ per mode from evaluation rows: {"τ chain": .., "τ tree B=16": ..}, chain first."""
    found: dict[int | None, tuple[list[float], list[float]]] = {}
    for i, row in enumerate(rows):
        if row.get("kind") != "eval":
            continue
        keys = {k: parse_tau_key(k) for k in row}
        if "tau" in row and not any(keys.values()):  # an eval line from before per-mode keys
            keys = {"tau": (None, 0.0)}
        for key, mode in keys.items():
            v = _number(row[key]) if mode is not None and mode[1] == 0 else None
            if v is not None:
                xs, ys = found.setdefault(mode[0], ([], []))
                xs.append(float(row.get("step", i)))
                ys.append(v)
    order = sorted(found, key=lambda b: -1 if b is None else b)
    return {("τ chain" if b is None else f"τ tree B={b}"): found[b] for b in order}


def metrics_of(inv, ref: str | None, *, target: str | None = None) -> MetricsSeries:
    """`dflashctl metrics`: the run `ref` (a run id, an experiment = its newest run, None = the newest run)
    found as `logs` finds it (ops.placement.resolve_first); its target opened, read (fetch_metrics), closed."""
    from orchestrator.ops.placement import resolve_first as resolve
    from orchestrator.target import open_target

    target_name, run_id, experiment = resolve(inv, ref, target)
    tgt = open_target(inv, target_name)
    try:
        return fetch_metrics(tgt, run_id, experiment=experiment)
    finally:
        tgt.close()


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
            out.panels[title] = [title]
    out.notes = run_notes(rows)
    regen = regen_series(rows)
    if regen:
        out.series.update(regen)
        out.panels.update({title: [title] for title in regen})
    real = _real_tau(rows)
    if real:
        out.series.update(real)
        sim = [k for k in ("simulated τ",) if k in out.panels]
        out.panels.pop("simulated τ", None)
        out.panels[TAU_PANEL] = sim + list(real)
    return out


REGEN_PANELS = ("regeneration tokens/s", "regeneration done (fraction of conversations)")


def regen_series(rows: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """The data stage's progress (trainer.regenerate's `kind: regen` records) against its elapsed seconds:
    tokens/s of all engines, and the fraction of the conversations done. Empty when the run regenerated nothing."""
    xs, rate, done = [], [], []
    for row in rows:
        if row.get("kind") != "regen" or not row.get("regen_conversations_total"):
            continue
        xs.append(float(row.get("regen_elapsed_s") or 0.0))
        rate.append(float(row.get("regen_tokens_per_s") or 0.0))
        done.append(row.get("regen_conversations", 0) / row["regen_conversations_total"])
    return {REGEN_PANELS[0]: (xs, rate), REGEN_PANELS[1]: (xs, done)} if xs else {}


def render_terminal(ms: MetricsSeries, width: int = 100, height: int = 12) -> str:
    """Draw each series as a small plotext chart (plain text, no colours); returns the text."""
    import plotext

    fig = plotext.figure
    parts = []
    for title, names in ms.panels.items():
        fig.clear()
        fig.plot_size(width, max(height, 2 * len(names) + 8) if len(names) > 1 else height)  # room for the legend
        for name, marker in zip(names, MARKERS):
            line = fig.signal(*ms.series[name], marker=marker)
            fig.draw(line.label(name) if len(names) > 1 else line)
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
    n = len(ms.panels)
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.2 * n), sharex=True, squeeze=False)
    for ax, (title, names) in zip(axes[:, 0], ms.panels.items()):
        for name in names:
            ax.plot(*ms.series[name], linewidth=1.2, marker="o" if name != "simulated τ" else None, markersize=3,
                    label=name)
        if len(names) > 1:
            ax.legend(fontsize=7, loc="best")
        ax.set_ylabel("τ" if title == TAU_PANEL else title)
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
