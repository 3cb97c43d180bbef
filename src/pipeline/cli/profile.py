"""pipeline_training_profile.py TRACE_OR_RUN_DIR [--rank N] [--top N] [--plot FILE | --no-plot] [--json FILE]

Summarises a torch.profiler trace of a training run (docs/profiling.md): the step time split into forward,
backward and optimizer (the ranges the trace's ProfilerStep#N steps hold), the top operators by self time (and GPU
kernels and collectives when the trace has them), the peak memory; and draws allocated memory over time as a PNG
when memory was recorded (profiling.record_memory_history=true).

TRACE_OR_RUN_DIR is a trace (rank-N.json.gz, or any Chrome-trace JSON torch.profiler wrote) or a run directory,
whose records (metrics_summary.json / events.ndjson) name its traces; there --rank picks one (default: the first).

  --rank N      the rank's trace of a run directory (default: the lowest recorded)
  --top N       operators and kernels listed (default 15)
  --plot FILE   where the memory PNG goes (default: beside the trace, <trace>.memory.png)
  --no-plot     no PNG
  --json FILE   the summary as JSON as well ('-': stdout, instead of the text)

Capture a trace: a training run with profiling.use_pytorch_profiler=true profiling.profile_step_start=2
profiling.profile_step_end=4 (steps 2-3) [profiling.record_memory_history=true], on either engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.cli.parser import Parser, positive_int
from pipeline.common import shell
from pipeline.common.errors import UserError, cli_main
from pipeline.common.io import write_output_text
from pipeline.training import goodput, profiling, records


def build_parser() -> Parser:
    p = Parser(prog="pipeline_training_profile.py", description=__doc__)
    p.add_argument("target", type=Path, help="a trace file or a run directory")
    p.add_argument("--rank", type=int, help="the rank's trace of a run directory")
    p.add_argument("--top", type=positive_int, default=15)
    p.add_argument("--plot", type=Path)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", metavar="FILE")
    return p


def find_trace(target: Path, rank: int | None) -> tuple[Path, dict | None]:
    """The trace to read and its capture record (None for a bare trace file)."""
    if target.is_file():
        if rank is not None:
            raise UserError("--rank picks a trace of a run directory; the argument is already a trace file")
        return target, None
    if not target.is_dir():
        raise UserError(f"{target} is neither a trace file nor a run directory")
    captures = records.profile_records(goodput.read_events(target))
    if not captures:
        found = sorted((target / profiling.TRACE_DIR).glob("rank-*.json.gz"))
        if not found:
            raise UserError(f"run directory {target} has no profiler trace: its events.ndjson records no capture "
                            f"and {target / profiling.TRACE_DIR} holds none; train with "
                            "profiling.use_pytorch_profiler=true (docs/profiling.md)")
        captures = [{"rank": int(p.name.split("-")[1].split(".")[0]), "trace": str(p)} for p in found
                    if p.name.split("-")[1].split(".")[0].isdigit()]
    if rank is not None:
        chosen = [c for c in captures if c.get("rank") == rank]
        if not chosen:
            raise UserError(f"run directory {target} has no trace of rank {rank}; recorded ranks: "
                            f"{', '.join(str(c.get('rank')) for c in captures)}")
        captures = chosen
    cap = captures[0]
    return Path(cap["trace"]), cap


@cli_main
def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.plot is not None and a.no_plot:
        raise UserError("--plot and --no-plot contradict each other: give one")
    path, cap = find_trace(a.target, a.rank)
    trace = profiling.load_trace(path)
    summary = profiling.summarize(trace, top=a.top)
    if cap is not None:
        summary["capture"] = cap
    plot = None
    if not a.no_plot:
        plot = profiling.plot_memory(trace, a.plot or path.with_name(path.name.split(".json")[0] + ".memory.png"))
        summary["memory_plot"] = str(plot) if plot else None
    if a.json:
        text = json.dumps(summary, indent=1) + "\n"
        if a.json == "-":
            sys.stdout.write(text)
            return 0
        write_output_text(Path(a.json), text)
    where = ""
    steps = cap.get("steps") if cap is not None else None
    if cap is not None and isinstance(steps, list) and len(steps) == 2 and all(isinstance(x, int) for x in steps):
        # (a record of another shape, [2] or 5, must not crash the summary)
        where = f" (rank {cap.get('rank')}, steps {steps[0]}-{steps[1]})"
    # an operator name or a path from the trace is never printed raw: control characters shown escaped
    print(shell.terminal_lines(profiling.format_summary(summary, where)))
    if plot is not None:
        print(shell.one_line(f"memory plot: {plot}"))
    elif not a.no_plot:
        print("memory plot: none (the trace has no memory events)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
