"""Profiling a tiny local run (issue 35): steps 2-3 of the tiny MoE SFT run recorded with torch.profiler, the trace
read by torch's own trace reader, the run's records pointing at it, and the profile command's summary of it."""

import json

import pytest

from tests.helpers import ROOT, run

pytestmark = pytest.mark.slow
PY = str(ROOT / ".venv/bin/python")
TRAIN = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--disable-ft"]
PROFILE = ["profiling.use_pytorch_profiler=true", "profiling.profile_step_start=2", "profiling.profile_step_end=4",
           "profiling.record_memory_history=true"]


def test_profile_steps_2_3_of_a_tiny_local_run(pipeline_env, tmp_path):
    from torch.profiler._trace_validator import validate_trace

    run([PY, "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
         "--limit", "200", "--quiet"], env=pipeline_env, check=True)
    run_dir = tmp_path / "run"
    res = run(["bash", "pipeline_training_launch.sh", *TRAIN, "--run-dir", str(run_dir), "train.train_iters=4",
               "train.global_batch_size=2", "checkpoint.save_interval=4", *PROFILE], env=pipeline_env, check=True)
    trace = run_dir / "torch_profile" / "rank-0.json.gz"
    assert "profiler: rank 0 records steps 2-3 with torch.profiler (memory: the profiler's profile_memory" in res.stderr
    assert validate_trace(str(trace)) == (True, [])  # torch's own reader of its Chrome traces
    # the records point at it: a profile event, and the summary's list of traces
    events = [json.loads(x) for x in (run_dir / "events.ndjson").read_text().splitlines()]
    [ev] = [e for e in events if e["event"] == "profile"]
    assert ev["trace"] == str(trace) and ev["steps"] == [2, 3] and ev["rank"] == 0 and ev["memory"] == "profile_memory"
    summary = json.loads((run_dir / "metrics_summary.json").read_text())
    assert summary["status"] == "completed" and summary["profile"][0]["trace"] == str(trace)

    out = run([PY, "pipeline_training_profile.py", str(run_dir), "--top", "8"], env=pipeline_env, check=True).stdout
    print(out)
    assert f"trace: {trace} (rank 0, steps 2-3)" in out
    assert "step time: 2 step(s) recorded" in out and "step 2:" in out and "step 3:" in out and "step 4:" not in out
    for part in ("forward", "backward", "optimizer"):
        line = next(x for x in out.splitlines() if x.startswith(f"  {part} "))
        assert float(line.split()[1]) > 0, line  # each part of the step shows in the trace's ranges
    assert "top 8 operators by self time (CPU):" in out and "aten::mm" in out
    assert "peak memory: cpu " in out
    png = run_dir / "torch_profile" / "rank-0.memory.png"
    assert f"memory plot: {png}" in out and png.read_bytes()[:4] == b"\x89PNG"
