"""Issue 35: every converted checkpoint evaluated, on the local Slurm. An experiment's training phase carries the
``upload-all --poll --eval pipeline_smoke`` rider; its two checkpoints are converted, verified and evaluated once
each, and ``experiment status`` shows the latest result with the per-run plot (metric against iteration) beside the
loss curve, and the results CSV has a column per task metric."""

from __future__ import annotations

import csv
import json
import re
import time

import pytest

from .test_experiments import experiment, png_size, prepare_chat, submitted
from .test_slurm import job_log, wait_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

EXP = """
name: evals{tag}
base:
  config: configs/local/tiny_moe_sft.yaml
  model: tiny-qwen3-moe
  mode: sft
  flags: [--disable-ft]
  sbatch: [--time=20]
phases:
  - name: train
    overrides: {{train.train_iters: 40, checkpoint.save_interval: 20}}
    upload_all: [--eval, pipeline_smoke, --eval-limit, "3", --interval, "2"]
"""


def test_upload_all_poll_eval_puts_both_checkpoints_on_the_board_csv_and_plot(senv, tmp_path):
    prepare_chat(senv, limit=800)
    tag = str(int(time.time()))[-6:]
    exp = tmp_path / "evals.yaml"
    exp.write_text(EXP.format(tag=tag))
    jobs = submitted(experiment(senv, "submit", exp, check=True).stdout)
    assert list(jobs) == ["base:train", "base:train.upload_all"], jobs
    assert wait_job(senv, jobs["base:train"], timeout=600) == "COMPLETED", job_log("training", jobs["base:train"])
    poll = jobs["base:train.upload_all"]
    assert wait_job(senv, poll, timeout=900) == "COMPLETED", job_log("checkpoint", poll)[-4000:]
    log = job_log("checkpoint", poll)
    ckpt = tmp_path / "runs" / f"evals{tag}.base.train" / "checkpoints"
    values = {}
    for it in (20, 40):
        assert log.count(f"evaluated iter_{it:07d} (pipeline_smoke.") == 1, log[-4000:]  # key: tasks + settings
        assert re.search(rf"^eval iter {it} pipeline_smoke: acc \d\.\d{{4}} ", log, re.M), log[-4000:]
        rec = json.loads((ckpt / f"iter_{it:07d}" / "hf" / "eval" / "pipeline_smoke.json").read_text())
        assert rec["harness"]["n-samples"]["pipeline_smoke"]["effective"] == 3
        values[it] = rec["summary"]["tasks"]["pipeline_smoke"]["value"]
        assert len(list((ckpt / "evaluated_checkpoints").glob(f"iter_{it:07d}.pipeline_smoke.*.done"))) == 1

    out = experiment(senv, "status", exp, check=True).stdout
    state = tmp_path / "runs" / "_experiments" / f"evals{tag}"
    plot = state / "eval" / "base.png"
    assert (f"  eval (latest, train iter 40): pipeline_smoke acc {values[40]:.4f} (2 iteration(s) evaluated); "
            f"eval plot {plot}") in out, out
    assert png_size(plot) == (600, 400) and png_size(state / "loss" / "base.png") == (600, 400)
    experiment(senv, "csv", exp, check=True)
    (row,) = csv.DictReader((state / "results.csv").open())
    assert row["eval_iteration"] == "40" and float(row["eval_pipeline_smoke_acc"]) == values[40]
    assert "eval_pipeline_smoke_acc_norm" in row
