"""Loss curves from ``progress.ndjson``: one PNG per run (a line per training phase, a later phase drawn from the
iteration it started from) and one overlay per experiment, in ``$PIPELINE_RUNS_DIR/_experiments/<experiment>/``.
matplotlib is imported here only (Agg backend: no display needed)."""

from __future__ import annotations

import io
from pathlib import Path

from pipeline.common.io import write_bytes
from pipeline.experiment.plan import RunPlan, state_dir
from pipeline.experiment.spec import Experiment
from pipeline.experiment.status import progress


def curves(rp: RunPlan) -> list[tuple[str, list[int], list[float]]]:
    """(phase, steps, losses) per training phase that has logged a loss; steps offset by the phase's start."""
    out = []
    for job in rp.jobs:
        if job.kind != "train":
            continue
        pts = [(r["step"] + job.start_iter, r["loss"]) for r in progress(job.run_dir)
               if isinstance(r.get("loss"), (int, float))]
        if pts:
            out.append((job.phase, [p[0] for p in pts], [p[1] for p in pts]))
    return out


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def write_plots(exp: Experiment, plans: list[RunPlan]) -> dict[str, Path]:
    """Write the PNGs of every run with data and the overlay; returns {label: path, "__overlay__": path}."""
    data = {rp.run.label: curves(rp) for rp in plans}
    if not any(data.values()):
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = state_dir(exp) / "loss"
    written: dict[str, Path] = {}
    for label, lines in data.items():
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for phase, steps, losses in lines:
            ax.plot(steps, losses, marker="." if len(steps) < 40 else None, label=phase)
        ax.set(title=f"{exp.name}.{label}", xlabel="step", ylabel="loss")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend()
        fig.tight_layout()
        written[label] = write_bytes(out_dir / f"{label}.png", _png(fig))
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, lines in data.items():
        steps = [s for _, st, _ in lines for s in st]
        losses = [v for _, _, lo in lines for v in lo]
        if steps:
            ax.plot(steps, losses, label=label)
    ax.set(title=f"{exp.name}: loss", xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    written["__overlay__"] = write_bytes(state_dir(exp) / "loss_curves.png", _png(fig))
    plt.close(fig)
    return written


def write_eval_plots(exp: Experiment, statuses) -> dict[str, Path]:
    """One PNG per run with evaluations (``eval/<label>.png`` beside ``loss/``): each task's headline metric
    against the step (the iteration, offset by its phase's start, as the loss curves). Returns {"<label>:eval":
    path}."""
    runs = [s for s in statuses if getattr(s, "evals", None)]
    if not runs:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: dict[str, Path] = {}
    for s in runs:
        series: dict[str, list[tuple[int, float]]] = {}
        for e in s.evals:
            for task, h in e["tasks"].items():
                if isinstance(h, dict) and isinstance(h.get("value"), (int, float)):
                    series.setdefault(f"{task} {h.get('metric')}", []).append((e["step"], float(h["value"])))
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set(title=f"{exp.name}.{s.label}: evaluation", xlabel="step", ylabel="metric")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        written[f"{s.label}:eval"] = write_bytes(state_dir(exp) / "eval" / f"{s.label}.png", _png(fig))
        plt.close(fig)
    return written
