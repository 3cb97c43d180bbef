"""Experiments on the local Slurm: a 2 x 2 sweep from one file (status while it runs and after, a CSV row per run,
a loss-curve PNG per run), a locked run whose override changed is refused, and a four-phase chain (pretrain ->
cooldown continuing the pretrain's last checkpoint -> export -> coherence) through afterok dependencies next to a
chain whose cooldown fails, which stops there and is named by status."""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import pytest

from pipeline.training.records import read_progress
from tests.helpers import ROOT, run

from .test_slurm import job_log, wait_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
PY = str(ROOT / ".venv/bin/python")

SWEEP = """
name: sweep{tag}
base:
  config: configs/local/tiny_moe_sft.yaml
  model: tiny-qwen3-moe
  mode: sft
  flags: [--disable-ft]
  sbatch: [--time=20]
  overrides:
    train.train_iters: 6
    checkpoint.save_interval: 3
    pipeline.local.fault_inject_step_sleep: 2.0
grid:
  optimizer.lr: [3.0e-3, 1.0e-3]
  train.global_batch_size: [2, 4]
computed:
  optimizer.min_lr: ${{calc:'${{optimizer.lr}} / 10'}}
"""

CHAIN = """
name: chain{tag}
base:
  config: configs/local/tiny_moe_sft.yaml
  model: tiny-qwen3-moe
  mode: sft
  flags: [--disable-ft]
  sbatch: [--time=20]
phases:
  - name: pretrain
    overrides: {{train.train_iters: {pre}, checkpoint.save_interval: {save}}}
  - name: cooldown
    from: pretrain
    iteration: last
    tokens: {tokens}
    overrides: {{optimizer.lr: 1.0e-4, optimizer.min_lr: 1.0e-5, scheduler.lr_decay_style: linear,
                 scheduler.lr_warmup_iters: 0{extra}}}
  - name: export
    kind: export
    args: [--atol, "1e-2"]
  - name: coherence
    kind: coherence
    args: [--max-tokens, "8", --allow-empty]
"""


def experiment(env, *args, check=False):
    return run([PY, "pipeline_experiment.py", *map(str, args)], env=env, check=check, timeout=600)


def prepare_chat(env, limit: int = 600) -> None:
    run([PY, "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
         "--limit", str(limit), "--quiet"], env=env, check=True)


def submitted(out: str) -> dict[str, str]:
    """{"<label>:<phase>": job id} from submit's output."""
    return {f"{m.group(1)}:{m.group(2)}": m.group(3) for m in re.finditer(r"^(\S+): (\S+): job (\d+)", out, re.M)}


def png_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.size


def test_sweep_status_csv_plots_and_lock(senv, tmp_path):
    prepare_chat(senv)
    tag = str(int(time.time()))[-6:]
    exp = tmp_path / "sweep.yaml"
    exp.write_text(SWEEP.format(tag=tag))
    res = experiment(senv, "submit", exp, check=True)
    jobs = submitted(res.stdout)
    assert len(jobs) == 4 and "preflight: PASS (4 run(s), 4 job(s))" in res.stdout, res.stdout
    labels = sorted(k.split(":")[0] for k in jobs)
    assert labels == ["lr0.001_gbs2", "lr0.001_gbs4", "lr0.003_gbs2", "lr0.003_gbs4"]
    locks = tmp_path / "locks" / f"sweep{tag}"
    assert sorted(p.name for p in locks.iterdir()) == [f"{x}.lock.yaml" for x in labels]

    # while the runs train: a row per run with Slurm's state and a step / total, and a loss curve drawn mid-run.
    # A curve is known to be partial when its run had a step before the status that drew it began and fewer than
    # all six after it returned (progress.ndjson only grows); each step sleeps 2 s so such a window exists.
    def steps(label: str) -> int:  # the file's one reader, as the board and the plots read it
        return len(read_progress(tmp_path / "runs" / f"sweep{tag}.{label}"))

    deadline, shown, seen = time.time() + 300, None, None
    while time.time() < deadline and not (shown and seen):
        before = {label: steps(label) for label in labels}
        out = experiment(senv, "status", exp, check=True).stdout
        after = {label: steps(label) for label in labels}
        rows = [line for line in out.splitlines() if re.match(r"lr0\.00[13]_gbs[24]\s+train", line)]
        assert len(rows) == 4, out
        shown = shown or next((r.split()[0] for r in rows if re.search(r"RUNNING\s+[1-5]/6\s+\d+\.\d{4}", r)), None)
        partial = [label for label in labels if before[label] >= 1 and after[label] < 6]
        if partial and seen is None:
            seen = partial[0]
            mid = (tmp_path / "runs" / "_experiments" / f"sweep{tag}" / "loss" / f"{seen}.png").read_bytes()
        time.sleep(1)
    assert shown, "no run was shown mid-training with a step and a loss"
    assert seen, "no loss curve was drawn mid-training"

    for job in jobs.values():
        assert wait_job(senv, job, timeout=400) == "COMPLETED", job_log("training", job)[-3000:]
    out = experiment(senv, "status", exp, check=True).stdout
    for label in labels:
        assert re.search(rf"^{label}\s+train\s+\d+\s+COMPLETED\s+6/6\s+\d+\.\d{{4}}\s+\d+\s+6\b", out, re.M), out
        assert f"{label}: done; loss curve" in out
        assert re.search(rf"^{label}\s+train\s.*\s\d+%$", out, re.M), out  # goodput, from the run's events
    assert len(re.findall(r"^  train time: goodput \d+% of \d+s allocated; \d+s from submission: queue", out,
                          re.M)) == 4, out
    pngs = {label: tmp_path / "runs" / "_experiments" / f"sweep{tag}" / "loss" / f"{label}.png" for label in labels}
    overlay = tmp_path / "runs" / "_experiments" / f"sweep{tag}" / "loss_curves.png"
    assert str(overlay) in out
    # valid images whose bytes follow the data: four different curves, four different files
    assert all(png_size(p) == (600, 400) for p in pngs.values()) and png_size(overlay) == (800, 500)
    assert len({p.read_bytes() for p in pngs.values()}) == 4
    assert pngs[seen].read_bytes() != mid  # the same run's curve, drawn with more steps

    res = experiment(senv, "csv", exp, "--changed", check=True)
    rows = list(csv.DictReader((tmp_path / "runs" / "_experiments" / f"sweep{tag}" / "results.changed.csv").open()))
    assert len(rows) == 4 and {r["run"] for r in rows} == set(labels)
    for r in rows:
        assert r["status"] == "done" and r["steps"] == "6" and float(r["final_loss"]) < 11.5
        assert float(r["best_loss"]) <= float(r["final_loss"])
        assert int(r["tokens"]) == 6 * 256 * int(r["train.global_batch_size"])
        assert float(r["optimizer.min_lr"]) == pytest.approx(float(r["optimizer.lr"]) / 10)
        assert 0 < float(r["goodput"]) < 1 and float(r["submission_to_end_seconds"]) > 0

    # a locked run whose override changed is refused, naming the key; nothing is submitted
    exp.write_text(SWEEP.format(tag=tag).replace("train.train_iters: 6", "train.train_iters: 8"))
    res = experiment(senv, "submit", exp, "--only", "lr0.003_gbs2")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "differs from its lock" in res.stderr and "train:train.train_iters: 6 -> 8" in res.stderr
    assert "nothing was submitted" in res.stderr and "job " not in res.stdout
    # re-locking does not let the changed config finish the finished run directory either
    res = experiment(senv, "submit", exp, "--only", "lr0.003_gbs2", "--relock")
    assert res.returncode == 2 and "holds a run with a different config (train.train_iters: 6 -> 8)" in res.stderr
    # nor does a relaunch that bypasses the experiment: the training launcher refuses, one line, exit 2
    name = f"sweep{tag}.lr0.003_gbs2"
    res = run(["bash", "pipeline_training_launch.sh", "configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe",
               "--mode", "sft", "--disable-ft", "train.train_iters=8", "checkpoint.save_interval=3",
               "optimizer.lr=0.003", "train.global_batch_size=2", "optimizer.min_lr=0.0003",
               "pipeline.local.fault_inject_step_sleep=2.0", f"logger.wandb_exp_name={name}"], env=senv)
    assert res.returncode == 2 and "training already finished" not in res.stdout
    err = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "train.train_iters: 6 -> 8" in err[0] and "--allow-config-change" in err[0], res.stderr
    summary = json.loads((tmp_path / "runs" / name / "metrics_summary.json").read_text())
    assert summary["final_step"] == 6  # the finished run is untouched

    # runs edited out of the file after submit are still shown, with Slurm's state and their log (they were hidden)
    exp.write_text(SWEEP.format(tag=tag).replace("optimizer.lr: [3.0e-3, 1.0e-3]", "optimizer.lr: [3.0e-3]"))
    out = experiment(senv, "status", exp, "--no-plots", check=True).stdout
    for label in ("lr0.001_gbs2", "lr0.001_gbs4"):
        assert re.search(rf"^{label}\s+train\s+{jobs[label + ':train']}\s+COMPLETED\b", out, re.M), out
        assert re.search(rf"^{label}: done \(submitted, but no longer in the experiment file; log \S+", out, re.M), out


def test_chain_through_afterok_and_a_failing_phase_stops_its_chain(senv, tmp_path):
    prepare_chat(senv, limit=800)
    tag = str(int(time.time()))[-6:]
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    # The pretrain is the checkpoint tests' trained tiny model (40 iterations, the config's cosine schedule, 800
    # conversations), the cooldown continues it at a low rate (as their poller test does), so the export passes
    # its verification (reference loss well below uniform, non-empty greedy generations); a 30 + 10 constant-rate
    # chain was seen to fail it.
    good.write_text(CHAIN.format(tag=f"{tag}ok", pre=40, save=20, tokens=4 * 4 * 256, extra=""))
    bad.write_text(CHAIN.format(tag=f"{tag}nan", pre=4, save=2, tokens=4 * 4 * 256,
                                extra=", pipeline.local.fault_inject_nan_step: 1"))
    render = experiment(senv, "render", good, "--no-configs", check=True).stdout
    assert re.search(r'"--dependency=afterok:\$\{JOB_1%%;\*\}".*pipeline_training_submit\.sbatch .*'
                     r"checkpoint\.load=\S+pretrain/checkpoints checkpoint\.ckpt_step=40 train\.train_iters=44",
                     render), render
    assert re.search(r'"--dependency=afterok:\$\{JOB_2%%;\*\}" .*pipeline_checkpoint_submit\.sbatch export ', render), render
    assert not (tmp_path / "runs" / "_experiments").exists()  # render submits nothing

    jobs = submitted(experiment(senv, "submit", good, check=True).stdout)
    bad_jobs = submitted(experiment(senv, "submit", bad, check=True).stdout)
    assert list(jobs) == ["base:pretrain", "base:cooldown", "base:export", "base:coherence"]
    info = run(["scontrol", "show", "job", jobs["base:cooldown"], "-o"], env=senv).stdout
    assert f"Dependency=afterok:{jobs['base:pretrain']}" in info

    # the failing chain: its cooldown stops on a NaN; Slurm cancels export and coherence itself
    # (--kill-on-invalid-dep=yes: they were left pending for ever before), and status names the phase and says so
    assert wait_job(senv, bad_jobs["base:cooldown"], timeout=400) == "FAILED"
    assert wait_job(senv, bad_jobs["base:export"], timeout=60) == "CANCELLED"
    assert wait_job(senv, bad_jobs["base:coherence"], timeout=60) == "CANCELLED"
    out = experiment(senv, "status", bad, check=True).stdout
    assert f"base: stopped at cooldown (FAILED, job {bad_jobs['base:cooldown']}); export, coherence will not run" \
        in out, out
    assert (f"2 job(s) behind a phase that failed were cancelled by Slurm (their dependency can never be satisfied): "
            f"{bad_jobs['base:export']} {bad_jobs['base:coherence']}") in out, out

    # the good chain completes, each phase from the previous phase's outputs
    for phase in ("pretrain", "cooldown", "export", "coherence"):
        st = wait_job(senv, jobs[f"base:{phase}"], timeout=500)
        log = job_log("training" if phase in ("pretrain", "cooldown") else phase if phase == "coherence"
                      else "checkpoint", jobs[f"base:{phase}"])
        assert st == "COMPLETED", (phase, log[-3000:])
    runs = tmp_path / "runs"
    cool = runs / f"chain{tag}ok.base.cooldown"
    assert f"continuing from {runs}/chain{tag}ok.base.pretrain/checkpoints/iter_0000040" in \
        job_log("training", jobs["base:cooldown"])
    assert json.loads((cool / "metrics_summary.json").read_text())["final_step"] == 44
    hf = cool / "checkpoints" / "iter_0000044" / "hf"
    assert json.loads((hf / "verification.json").read_text())["verdict"] == "PASS"
    report = json.loads((hf / "coherence" / "coherence_hf.json").read_text())
    assert report["results"][0]["summary"]["num_prompts"] == 8
    out = experiment(senv, "status", good, check=True).stdout
    assert "base: done" in out
    assert re.search(r"^base\s+cooldown\s+\d+\s+COMPLETED\s+44/44\s+\d+\.\d{4}\s+\d+\s+44\s", out, re.M), out
    assert re.search(r"^base\s+coherence\s+\d+\s+COMPLETED\s.*8p empty", out, re.M), out
    png = runs / "_experiments" / f"chain{tag}ok" / "loss" / "base.png"
    assert png_size(png) == (600, 400)
    experiment(senv, "csv", good, check=True)
    (row,) = csv.DictReader((runs / "_experiments" / f"chain{tag}ok" / "results.csv").open())
    assert row["status"] == "done" and row["steps"] == "44" and row["coherence_num_prompts"] == "8"
