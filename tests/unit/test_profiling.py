"""Profiling (issue 35): the typed fields and their checks, the local engine's recorder on a real torch.profiler (a
tiny model, no training run: the run itself is tests/integration/test_profiling.py), and the profile command."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.cli.profile import main as profile_main
from pipeline.config.schema import ProfilingConfig, TrainingConfig
from pipeline.training import goodput, profiling, records

QUICKSTART = "configs/local/tiny_moe_sft.yaml"
DRY = [QUICKSTART, "--model", "tiny-qwen3-moe", "--mode", "sft", "--dry-run", "--no-path-checks"]


@pytest.mark.parametrize("start,end,steps", [(2, 4, (2, 3)), (10, 12, (10, 11)), (0, 3, (1, 2)), (1, 2, (1, 1)),
                                             (3, 3, None), (0, 1, None)])
def test_window_is_bridges_schedule(start, end, steps):
    """Steps start .. end-1 (1-based), as Bridge's schedule (wait start-1, warmup 1, active end-start) records them;
    tests/bridge checks this against Bridge's own profiler functions."""
    assert profiling.window(start, end) == steps


def test_profiling_fields_are_typed():
    cfg = TrainingConfig.from_dict({"profiling": {"use_pytorch_profiler": True, "profile_step_start": 2,
                                                  "profile_ranks": [0, 1]}})
    assert cfg.problems == [] and cfg.profiling.profile_ranks == [0, 1] and cfg.extra == {}
    bad = TrainingConfig.from_dict({"profiling": {"profile_ranks": 0, "profile_step_end": "4",
                                                  "use_pytorch_profiler": "yes"}})
    assert bad.problems == [
        "profiling.profile_ranks=0 must be a list, e.g. profiling.profile_ranks=[0,1]",
        "profiling.profile_step_end='4' must be an integer (it is the string '4': an ${oc.env:VAR} value is a string; "
        "wrap it as ${oc.decode:${oc.env:VAR}}, or drop the quotes)",
        "profiling.use_pytorch_profiler='yes' must be a boolean (true/false)"]
    assert TrainingConfig.from_dict({"profiling": {"profile_ranks": [0, "x"]}}).problems == [
        "profiling.profile_ranks[1]='x' must be an integer"]


@pytest.mark.parametrize("overrides,needle", [
    (["profiling.use_pytorch_profiler=true", "profiling.use_nsys_profiler=true"], "allows one profiler at a time"),
    (["profiling.use_pytorch_profiler=true", "profiling.profile_step_start=5", "profiling.profile_step_end=3"],
     "profiling.profile_step_end(3) must be >= profiling.profile_step_start(5)"),
    (["profiling.use_pytorch_profiler=true", "profiling.profile_step_start=4", "profiling.profile_step_end=4"],
     "records no step"),
    (["profiling.use_pytorch_profiler=true", "train.train_iters=8"],  # Bridge's default window: steps 10-11
     "profiling records steps 10-11 but train.train_iters is 8"),
    (["profiling.use_pytorch_profiler=true", "profiling.profile_step_start=2", "profiling.profile_step_end=4",
      "profiling.profile_ranks=[0,5]"], "profiling.profile_ranks [5] are not ranks of this run (world size 1"),
    (["profiling.use_nsys_profiler=true"], "the local engine records with torch.profiler"),
    (["profiling.profile_step_start=-1"], "profiling.profile_step_start=-1 must be >= 0"),
])
def test_preflight_refuses_a_window_that_cannot_work(overrides, needle, capsys):
    """One line each, exit 2, before anything starts (Bridge asserts the first two on the GPU node, after the queue;
    the others would run and record nothing)."""
    from pipeline.cli.train import main

    assert main([*DRY, "--cluster", "local_cpu", *overrides]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def _tiny_steps(recorder, steps=range(1, 6)):
    """A tiny model's optimizer steps through the recorder, as the local engine's callbacks drive it; whether a
    profiler was active during each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    active, written = {}, []
    for step in steps:
        recorder.begin(step)
        active[step] = recorder.prof is not None and torch.autograd.profiler._is_profiler_enabled
        with recorder.span("forward"):
            loss = model(torch.randn(16, 32)).pow(2).mean()
        with recorder.span("backward"):
            loss.backward()
        recorder.open("optimizer")
        opt.step()
        recorder.close("optimizer")
        opt.zero_grad()
        rec = recorder.end(step, final=step == max(steps))
        if rec:
            written.append(rec)
    return active, written


def test_recorder_records_exactly_the_window(tmp_path):
    """Steps 2-3 of 5: a profiler exists only during them (outside, no profiler object and torch's profiler is off:
    nothing recorded, nothing paid); the trace torch's own reader accepts holds ProfilerStep#2 and #3 with their
    forward, backward and optimizer ranges, and the CPU memory events of profile_memory."""
    from torch.profiler._trace_validator import validate_trace

    p = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4,
                        record_memory_history=True)
    cap = profiling.Capture.for_rank(p, 0, tmp_path, cuda=False)
    assert cap is not None and (cap.first, cap.last, cap.memory, cap.snapshot) == (2, 3, True, None)
    active, written = _tiny_steps(profiling.Recorder(cap))
    assert active == {1: False, 2: True, 3: True, 4: False, 5: False}
    assert len(written) == 1 and written[0]["steps"] == [2, 3] and written[0]["memory"] == "profile_memory"
    trace = tmp_path / "torch_profile" / "rank-0.json.gz"
    assert written[0]["trace"] == str(trace) and trace.is_file()
    assert validate_trace(str(trace)) == (True, [])
    s = profiling.summarize(profiling.load_trace(trace))
    assert [r["step"] for r in s["steps"]] == [2, 3]
    for r in s["steps"]:
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["optimizer_ms"] > 0
        assert r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"] + r["other_ms"] == pytest.approx(r["ms"])
    assert any(op["name"] == "aten::addmm" for op in s["top_operators"])
    assert s["peak_memory_bytes"]["cpu"] > 16 * 64 * 4  # at least one activation


def test_recorder_other_ranks_and_off(tmp_path):
    on = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4, profile_ranks=[1])
    assert profiling.Capture.for_rank(on, 0, tmp_path, cuda=False) is None
    assert profiling.Capture.for_rank(on, 1, tmp_path, cuda=False).trace.name == "rank-1.json.gz"
    every = ProfilingConfig(use_pytorch_profiler=True, profile_ranks=[])  # [] = every rank (Bridge's rule)
    assert profiling.Capture.for_rank(every, 7, tmp_path, cuda=False) is not None
    assert profiling.Capture.for_rank(ProfilingConfig(), 0, tmp_path, cuda=False) is None  # default: off
    # the default window is Bridge's: steps 10-11
    cap = profiling.Capture.for_rank(ProfilingConfig(use_pytorch_profiler=True), 0, tmp_path, cuda=False)
    assert (cap.first, cap.last) == (10, 11)


def test_a_run_ending_inside_the_window_still_writes_its_trace(tmp_path):
    """A save-and-exit (or a short run) inside the window: the steps done so far are written at the end."""
    p = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=10)
    _, written = _tiny_steps(profiling.Recorder(profiling.Capture.for_rank(p, 0, tmp_path, cuda=False)), range(1, 5))
    assert [w["steps"] for w in written] == [[2, 4]]


@pytest.fixture(scope="module")
def run_with_trace(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    p = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4,
                        record_memory_history=True)
    _, written = _tiny_steps(profiling.Recorder(profiling.Capture.for_rank(p, 0, run, cuda=False)))
    for w in written:
        records.record_profile(run, w)
    return run


def test_profile_command_on_a_run_directory(run_with_trace, capsys):
    """The run's records name its trace; the summary, and the memory picture beside the trace."""
    assert profile_main([str(run_with_trace), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert f"trace: {run_with_trace / 'torch_profile' / 'rank-0.json.gz'} (rank 0, steps 2-3)" in out
    assert "step time: 2 step(s) recorded" in out and "step 2:" in out and "step 3:" in out
    for part in ("forward", "backward", "optimizer", "other"):
        assert f"  {part:<10}" in out
    assert "top 5 operators by self time (CPU):" in out and "aten::addmm" in out
    assert "peak memory: cpu " in out and " MiB allocated" in out
    png = run_with_trace / "torch_profile" / "rank-0.memory.png"
    assert f"memory plot: {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_command_json(run_with_trace, capsys):
    assert profile_main([str(run_with_trace / "torch_profile" / "rank-0.json.gz"), "--json", "-", "--no-plot"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in s["steps"]] == [2, 3] and s["peak_memory_bytes"]["cpu"] > 0
    assert "memory_plot" not in s


@pytest.mark.parametrize("argv,needle", [
    (["{tmp}/missing"], "is neither a trace file nor a run directory"),
    (["{tmp}/not_a_trace.json"], "is not a torch.profiler trace"),
    (["{tmp}/list.json"], "is JSON but not a Chrome trace"),
    (["{tmp}"], "has no profiler trace"),
    (["{run}", "--rank", "3"], "has no trace of rank 3; recorded ranks: 0"),
    (["{run}", "--top", "0"], "--top: 0 must be >= 1"),
    (["{run}", "--plot", "x.png", "--no-plot"], "--plot and --no-plot contradict each other"),
])
def test_profile_command_bad_input_is_one_line_exit_2(run_with_trace, tmp_path, capsys, argv, needle):
    (tmp_path / "not_a_trace.json").write_text("hello")
    (tmp_path / "list.json").write_text('{"a": 1}')
    argv = [a.format(tmp=tmp_path, run=run_with_trace) for a in argv]
    assert profile_main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_summary_lists_the_latest_capture_per_rank(tmp_path):
    for rank, steps in ((0, [2, 3]), (1, [2, 3]), (0, [12, 13])):
        records.record_profile(tmp_path, {"rank": rank, "steps": steps, "trace": f"/t/rank-{rank}.json.gz"})
    caps = records.profile_records(goodput.read_events(tmp_path))
    assert [(c["rank"], c["steps"]) for c in caps] == [(0, [12, 13]), (1, [2, 3])]
    progress = records.ProgressLog(tmp_path, tokens_per_step=1)
    assert progress.summarize("completed", 4)["profile"] == caps


def test_profiling_a_resumed_run_is_the_same_run(tmp_path):
    """Tracing some steps of a relaunch changes no result: the profiling keys are not the run's identity (like W&B's
    directory), so a resume with them is not refused as another config."""
    import yaml

    base = {"train": {"train_iters": 8}, "logger": {"wandb_exp_name": "r"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(TrainingConfig.from_dict(base).to_dict()))
    profiled = {**base, "profiling": {"use_pytorch_profiler": True, "profile_step_start": 5, "profile_step_end": 7}}
    assert records.check_run_identity(tmp_path, TrainingConfig.from_dict(profiled)) == {}
    assert records.config_identity(TrainingConfig.from_dict(profiled)) == records.config_identity(
        TrainingConfig.from_dict(base))


def test_hostile_trace_events_are_skipped_not_tracebacks(tmp_path):
    """Issue 50 item 13: an event without a name or with a list as its name, and NaN/Infinity memory values, were
    tracebacks in the summary; --plot onto a folder or under a file was a traceback and left a stray temporary."""
    import json

    from pipeline.common.errors import UserError

    events = [
        {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 5},                               # no name
        {"ph": "X", "cat": "cpu_op", "name": ["a", "b"], "ts": 1, "dur": 2},           # a list as its name
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2, "dur": 3},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 10},
        {"ph": "i", "name": "[memory]", "ts": 3, "args": {"Total Allocated": float("nan"), "Device Type": 0}},
        {"ph": "i", "name": "[memory]", "ts": 4, "args": {"Total Allocated": float("inf"), "Device Type": 0}},
        {"ph": "i", "name": "[memory]", "ts": float("nan"), "args": {"Total Allocated": 7, "Device Type": 0}},
        {"ph": "i", "name": "[memory]", "ts": 5, "args": {"Total Allocated": 2**20, "Device Type": 0}},
    ]
    trace_file = tmp_path / "rank-0.json"
    trace_file.write_text(json.dumps({"traceEvents": events}))  # NaN/Infinity as Python's json writes them
    trace = profiling.load_trace(trace_file)
    s = profiling.summarize(trace)
    assert isinstance(s, dict)
    assert profiling.memory_series(trace) == {"cpu": [(0.005, 2**20)]}
    out = profiling.plot_memory(trace, tmp_path / "m.png")
    assert out == tmp_path / "m.png" and out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UserError, match="is a folder"):
        profiling.plot_memory(trace, tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="cannot create directory"):
        profiling.plot_memory(trace, tmp_path / "afile" / "m.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "m.png", "rank-0.json"]  # no stray temporary
