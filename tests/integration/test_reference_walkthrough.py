"""The reference's Quickstart Walkthrough (Steps 0-6 of the reference system's README) replayed on the Isambard
profile, in dry-run form, by one test (issue 33): every command as the reference writes it, translated only where
our command differs (the walkthrough table of docs/cluster.md says how), each planned or refused with the one-line
reason docs/cluster.md documents. ``isambard_sbatch --test-only`` goes to the local Slurm (4 nodes of 2 CPUs: it
checks the request, queues nothing); the test venv stands in for the login node's planner; the cluster's paths
(/projects/a5k/public/...) are not on this machine, so a command that checks them is refused for that reason, and
its plan is shown with ``--no-path-checks`` or, for the jobs that read what an earlier step writes, with
``--dependency=afterok`` on a held job (their inputs are then the job's to check, as on the cluster). On a machine
that has those paths (the cluster's own login node) the rows refused for their absence are not asserted there
(tests/integration/test_planner_real_data.py plans with the data present)."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, run

pytestmark = pytest.mark.slurm

CONFIG = "configs/quickstart/nemotron_nano_quickstart_sft.yaml"
CKPT = "/projects/a5k/public/checkpoints/megatron/nemotron_nano_quickstart_sft"
NANO_HF = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
DATASET = "geodesic-research/pa-warm-start-1B-sft-mix"
SB = str(ROOT / "isambard_sbatch")
TRAIN = [SB, "--test-only", "--nodes=16", "pipeline_training_submit.sbatch", CONFIG, "nano", "sft", "--disable-ft"]
DEMO = ["train.train_iters=200", f"checkpoint.save={CKPT}", "checkpoint.save_optim=false", "checkpoint.save_rng=false"]
EXPORT = ["pipeline_checkpoint_submit.sbatch", "export", CKPT, "--hf-model", NANO_HF, "--no-reasoning", "--iteration",
          "200"]
COHERENCE = ["pipeline_coherence_submit.sbatch", f"{CKPT}/iter_0000200/hf"]
SUPER_HF = "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
SUPER_CKPT = "/projects/a5k/public/checkpoints/megatron/nemotron_super_quickstart_sft"
MEGATRON_COHERENCE = ["pipeline_coherence_submit.sbatch", SUPER_CKPT, "--backend", "megatron", "--hf-model", SUPER_HF,
                      "--tp", "4", "--ep", "4", "--max-tokens", "256"]
SLURM_OK = r"sbatch: Job \d+ to start at"


@dataclass(frozen=True)
class Case:
    row: str          # the row of docs/cluster.md's walkthrough table (step number + letter)
    argv: list[str]   # "$HELD" is the held job a dependent submission waits for
    rc: int
    says: list[str]   # regexes the output must match (the plan, or the one-line reason)
    absent: tuple[str, ...] = ()  # cluster paths whose absence the row's refusal is about (issue 59, item 8)


CASES = [
    # Step 0: the environment. The install itself runs on a GPU node; its plan is the step list of the runtime.
    Case("0a", ["bash", "pipeline_env_setup.sh", "--list"], 0, [r"^planner\npull\nnccl-plugin\noverlay\nvalidate$"]),
    Case("0b", [SB, "--test-only", "pipeline_env_submit.sbatch", "setup"], 0, [SLURM_OK]),
    Case("0c", [SB, "--test-only", "pipeline_env_submit.sbatch", "validate", "--run-training"], 0, [SLURM_OK]),
    # Step 1: the dataset. On a GPU profile prepare needs the model (decision 59); with it, the configs' packs.
    Case("1a", [SB, "--test-only", "pipeline_data_submit.sbatch", "prepare", "--dataset", DATASET, "--seq-length",
                "32768"], 2, [r"^error: pipeline_data_submit\.sbatch: prepare: cluster profile isambard_gh200 trains "
                              r"several models \(nano, super\): name the one the data is for with --model"]),
    Case("1b", [SB, "--test-only", "pipeline_data_submit.sbatch", "prepare", "--dataset", DATASET, "--seq-length",
                "32768", "--model", "nano"], 0, [SLURM_OK]),
    Case("1c", [sys.executable, "pipeline_data_prepare.py", "prepare", "--dataset", DATASET, "--seq-length", "32768",
                "--model", "nano", "--dry-run"], 0,
         [r"prepare: \S+ -> /projects/a5k/public/data/geodesic-research__pa-warm-start-1B-sft-mix/packed/"
          r"nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16_pad_seq_to_mult16/training_32768\.idx\.parquet"]),
    # Step 3: training. As written: the cluster's data and base checkpoint are not on this machine.
    Case("3a", TRAIN, 2, [r"^error: dataset\.dataset_root /projects/a5k/public/data/\S+ does not exist",
                          r"^error: checkpoint /projects/a5k/public/checkpoints/megatron_bridges/models/"
                          r"NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16 does not exist",
                          # no image was validated on this machine: Step 0's validate records it beside the SIF
                          r"^error: the image's package record /projects/a5k/public/containers/nemo-26\.06\.sif\."
                          r"packages\.txt does not exist: the nano sft recipe needs transformer-engine, mamba-ssm, "
                          r"causal-conv1d, deep-ep",
                          r"^error: preflight: 3 problem\(s\); nothing was submitted"],
         absent=("/projects/a5k/public/data/geodesic-research__pa-warm-start-1B-sft-mix",
                 "/projects/a5k/public/checkpoints/megatron_bridges/models/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16",
                 "/projects/a5k/public/containers/nemo-26.06.sif.packages.txt")),
    # the demo command with the path checks left to the cluster: the preflight passes on 16 nodes, and the local
    # Slurm (4 nodes) refuses 16
    Case("3b", [*TRAIN, *DEMO, "--no-path-checks"], 1,
         [r"Preflight: PASS - world 64 \(tp 1 pp 1 cp 2 ep 4 dp 32\), memory estimate 91\.0 of 95 GB",
          r"More processors requested than permitted"]),
    # Step 5: export. As written before Step 3 ran: its checkpoint is not there; chained after training: planned.
    Case("5a", [SB, "--test-only", "--nodes=1", *EXPORT], 2,
         [rf"^error: checkpoint directory {CKPT} does not exist"], absent=(CKPT,)),
    Case("5b", [SB, "--test-only", "--dependency=afterok:$HELD", "--nodes=1", *EXPORT], 0,
         [r"Plan: PASS - export: world 4 on 1 node\(s\) \(tp 1 pp 1 ep 4\)", SLURM_OK]),
    # The reference's Super import (its Checkpoint Pipeline section): torchrun on every GPU of its 4 nodes (decision 83)
    Case("5c", [SB, "--test-only", "--nodes=4", "pipeline_checkpoint_submit.sbatch", "import", SUPER_HF], 0,
         [r"Plan: PASS - import: world 16 on 4 node\(s\) \(tp 1 pp 4 ep 4\)", SLURM_OK],
         absent=("/projects/a5k/public/checkpoints/megatron_bridges/models/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",)),
    # Step 6: coherence on the export, likewise.
    Case("6a", [SB, "--test-only", "--gpus-per-node=1", *COHERENCE], 2,
         [rf"^error: model {CKPT}/iter_0000200/hf does not exist"], absent=(f"{CKPT}/iter_0000200/hf",)),
    Case("6b", [SB, "--test-only", "--dependency=afterok:$HELD", "--gpus-per-node=1", *COHERENCE], 0,
         [r"Plan: PASS - coherence: world 1 on 1 node\(s\)", SLURM_OK]),
    # The reference's Megatron coherence (its Coherence section): Super's 88 layers do not split into --pp 6 stages
    # (megatron-core raises on every rank after the 6 nodes start: issue 34); the plan names the nearest layout that
    # runs, and that one (chained after the Super training it reads) is planned on 4 nodes.
    Case("6c", [SB, "--test-only", "--nodes=6", *MEGATRON_COHERENCE, "--pp", "6"], 2,
         [r"^error: pp\(6\) does not split the 88-layer hybrid pattern of super evenly \(88 % 6 = 4; "
          r"select_pipeline_segment\): megatron-core raises on every rank; use pp 4 or pp 8; the nearest layout that "
          r"runs: --tp 4 --pp 4 --ep 4 on 4 node\(s\)$"]),
    Case("6d", [SB, "--test-only", "--dependency=afterok:$HELD", "--nodes=4", *MEGATRON_COHERENCE, "--pp", "4"], 0,
         [r"Plan: PASS - coherence: world 16 on 4 node\(s\) \(tp 4 pp 4 ep 4\)", SLURM_OK]),
]


def _walkthrough_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "cluster.md").read_text()
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| (\d[a-z]?) \|.*$", text, re.M)}


def test_the_reference_walkthrough_plans_or_refuses_each_command(slurm, pipeline_env, tmp_path):
    env = {k: v for k, v in pipeline_env.items() if k != "PIPELINE_DATA_ROOT"}  # the profile's data root
    env.update({"SLURM_CONF": slurm["SLURM_CONF"], "PIPELINE_CLUSTER": "isambard_gh200",
                "PIPELINE_PLANNER_VENV": sys.prefix, "BAD_NODES_LOG": str(tmp_path / "bad.log")})
    held = subprocess.run(["sbatch", "--parsable", "--hold", "--job-name=walkthrough-step3", "-o", "/dev/null",
                           "--wrap", "true"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    try:
        def one(case: Case):
            return case, run([a.replace("$HELD", held) for a in case.argv], env=env, timeout=120)

        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(one, CASES))
    finally:
        subprocess.run(["scancel", held], env=env, capture_output=True)
    rows = _walkthrough_rows()
    for case, res in results:
        assert case.row in rows, f"docs/cluster.md has no walkthrough row | {case.row} |"
        if any(Path(p).exists() for p in case.absent):
            # this machine has the cluster's paths (the cluster's own login node): the row's refusal is about their
            # absence, so it says nothing here; tests/integration/test_planner_real_data.py plans with them present
            continue
        out = res.stdout + res.stderr
        assert res.returncode == case.rc, (case.row, res.returncode, out[-3000:])
        for pattern in case.says:
            assert re.search(pattern, out, re.M), (case.row, pattern, out[-3000:])
        if case.rc == 2:  # a refusal is one line per problem, each an error: line, and no traceback
            assert "Traceback" not in out and all(x.startswith("error: ") for x in res.stderr.splitlines()
                                                    if x.strip()), (case.row, res.stderr)

    # Step 2: the config the reference reviews has the values it names
    cfg = yaml.safe_load((ROOT / CONFIG).read_text())
    assert (cfg["train"]["global_batch_size"], cfg["train"]["micro_batch_size"], cfg["train"]["train_iters"]) == \
        (128, 1, 40)
    assert (cfg["model"]["seq_length"], cfg["model"]["context_parallel_size"],
            cfg["model"]["expert_model_parallel_size"], cfg["model"]["recompute_granularity"]) == (32768, 2, 4, "full")
    assert cfg["checkpoint"]["save"] is None and cfg["logger"]["wandb_save_dir"] == "/projects/a5k/public/logs/wandb"
    # Step 1's packs are the ones the config reads (dataset_root + the model's tokenizer and pad multiple)
    assert cfg["dataset"]["dataset_root"] == "/projects/a5k/public/data/geodesic-research__pa-warm-start-1B-sft-mix"
    assert "2" in rows and "1c" in rows
    # Step 4: the log the reference tails is the training job's --output; docs/cluster.md names the one it writes
    from pipeline.slurm.sbatch_options import directive_value

    log = directive_value(str(ROOT / "pipeline_training_submit.sbatch"), "--output").replace("%j", "<jobid>")
    assert f"`tail -f {log}`" in rows["4"], rows["4"]
