"""The megatron_cpu tier, fine-tuning: Megatron Bridge's own ``finetune()`` on the job users submit first (the README's
quickstart, ``nano sft`` on packed chat data), on 2 gloo processes, with only the model shrunk (issue 58, item 3).

The job: configs/quickstart/nemotron_nano_quickstart_sft.yaml as shipped (its batch of 128, micro-batch 1, optimizer,
learning rate, full recompute, packing specs with pad multiple 16, W&B logger, checkpoint settings), planned by the
product's planner (``pipeline.cli.train.plan_from_argv``) for the tier's cluster profile, its records written by the
product (``records.write_launch_records``) and launched with the plan's own torchrun command; each rank runs the
product's rank entry point (``pipeline.training.run`` -> the Bridge engine -> ``build_config`` on Bridge's Nano SFT
recipe -> ``run_training`` -> Bridge's ``finetune()``). What the CPU forces, and nothing else:

  the model                 Bridge's provider of the tier's tiny NemotronH, Nano's family (Mamba-2, attention and MoE
                            layers; tests/megatron_cpu/worker.py shrink_model, with every model setting of the user's
                            config copied onto it, the MoE ones included) and its tokenizer, its imported base
                            checkpoint as checkpoint.pretrained_checkpoint (issue 61; a tiny Llama before)
  seq 256, CP 1             32K tokens a pack on a CPU, context parallelism (TE's ring attention); the packs are
                            written at 256 by our data pipeline
  EP 2, alltoall            the quickstart's EP 4 over the 2 ranks there are (2 of the tiny model's 4 experts on
                            each; issue 62), its tokens exchanged by megatron-core's alltoall dispatcher over gloo:
                            the recipe's flex dispatcher is DeepEP's GPU kernels, with no reference to run on a CPU
                            (model.moe_token_dispatcher_type=alltoall is the user's own alternative)
  train_iters 4             a few steps (the quickstart's 40), and one validation iteration (the recipe's 32)
  checkpoint.save           a folder here (the quickstart saves nothing; the resume needs a save)
  dist gloo                 no NCCL on a CPU
  the distributed optimizer off where megatron-core has no TE/Apex FusedAdam (the product's own rule,
                            pipeline.bridge.NO_FUSED_ADAM: its torch-Adam fallback cannot resume; never the cluster)

The packs: ``pipeline_data_prepare.py prepare`` (our data pipeline's CLI) on chat JSONL with the tiny model's
tokenizer: more training packs than one global batch of 128, and a validation split of more (Bridge refuses fewer
on every rank; the preflight now says so on the login node). Megatron's own ``train.exit_interval`` stops one run at step 2 with a save (what a time-limit stop does);
its relaunch resumes from that save; the losses of every step equal those of an uninterrupted run of the same job.
Runs in the Bridge harness venv with the tier's CUDA stand-in, its training stand-in and the hybrid family's
(tests/megatron_cpu/standin: each patch classified; the packed-attention one is tested here against each document
alone, the Mamba scans over packed sequences in test_mamba_kernels.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import offline_hf_home, wandb_offline_runs
from tests.megatron_cpu.conftest import HERE, PROFILE, ROOT, VENV, tier_env, tier_run
from tests.megatron_cpu.worker import SFT_ITERS as ITERS
from tests.megatron_cpu.worker import SFT_PAD as PAD
from tests.megatron_cpu.worker import SFT_SEQ as SEQ
from tests.megatron_cpu.worker import chat_jsonl, sft_launch, sft_plan

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.slow]

STOP_AT = 2
GBS = 128  # the quickstart's train.global_batch_size, as shipped


def plan(work: Path, model: dict, run: str, *extra: str):
    return sft_plan(work / "data", model["hf"], model["meg"], work / run, *extra, experts=True)


def launch(p, env: dict) -> subprocess.CompletedProcess:
    r = sft_launch(p, Path(env["TINY_HF"]), env, [str(VENV / "bin" / "torchrun")])
    print(f"$ launch {p.run_dir} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def finetuned(nemotron_h, tmp_path_factory):
    """The packs (our data pipeline), then the quickstart job three times: uninterrupted (4 steps), and stopped at
    step 2 by Megatron's exit_interval, then relaunched (it resumes from the save)."""
    work = tmp_path_factory.mktemp("bridge_finetune_cpu")
    t0 = time.monotonic()
    prep = subprocess.run([sys.executable, str(ROOT / "pipeline_data_prepare.py"), "prepare", "--dataset",
                           str(chat_jsonl(work / "chat.jsonl")), "--seq-length", str(SEQ), "--tokenizer",
                           str(nemotron_h["hf"]), "--pad-seq-to-mult", str(PAD), "--dataset-root", str(work / "data"),
                           # a validation split of more packs than one global batch (the preflight's rule)
                           "--val-fraction", "0.3", "--workers", "1", "--quiet", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PIPELINE_CLUSTER": str(PROFILE), "HF_HUB_OFFLINE": "1"})
    assert prep.returncode == 0, prep.stderr[-3000:]
    prepared = json.loads(prep.stdout)
    env = tier_env({"MEGATRON_CPU_TRAINING": "1", "TMPDIR": str(work), "TINY_HF": str(nemotron_h["hf"]),
                    "HF_HOME": str(offline_hf_home(work / "hf_home")), "WANDB_MODE": "offline",
                    "TORCHELASTIC_ERROR_FILE": str(work / "torchelastic_error.json")})
    out = {"work": work, "prepared": prepared, "plans": {}, "runs": {}}
    os.environ["PIPELINE_CLUSTER"], old = str(PROFILE), os.environ.get("PIPELINE_CLUSTER")
    try:
        for name, extra in (("straight", ()), ("resumed", (f"+train.exit_interval={STOP_AT}",))):
            p = plan(work, nemotron_h, name, *extra)
            out["plans"][name] = p
            out["runs"][name] = [launch(p, env)]
            if name == "resumed":
                out["after_stop"] = {"summary": json.loads((work / name / "metrics_summary.json").read_text()),
                                     "tracker": (work / name / "checkpoints" / "latest_checkpointed_iteration.txt")
                                     .read_text().strip()}
                out["runs"][name].append(launch(plan(work, nemotron_h, name, *extra), env))
    finally:
        if old is None:
            os.environ.pop("PIPELINE_CLUSTER", None)
        else:
            os.environ["PIPELINE_CLUSTER"] = old
    out["seconds"] = time.monotonic() - t0
    print(f"prepare + 3 finetune() launches on 2 CPU ranks: {out['seconds']:.0f} s")
    return out


def test_the_plan_is_the_quickstarts_with_the_model_shrunk(finetuned):
    """The planner's only objection is the size of the model it plans (Nano on the tier's 4 GB 'GPUs'): the layout,
    batch, packing and paths (checked: the packs and the base checkpoint exist) pass as they do on the cluster."""
    p = finetuned["plans"]["straight"]
    assert len(p.preflight.problems) == 1 and p.preflight.problems[0].startswith("estimated memory"), \
        p.preflight.problems
    assert "path checks skipped (--no-path-checks)" not in p.preflight.notes
    # the tier's venv has no FusedAdam: the plan says what the distributed optimizer's resume needs (decision 106)
    assert any("not inspected from here" in n for n in p.preflight.notes), p.preflight.notes
    cfg = p.cfg
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.optimizer.lr) == (GBS, 1, 5.0e-6)
    assert (cfg.model.recompute_granularity, cfg.dataset.offline_packing_specs.pad_seq_to_mult) == ("full", PAD)
    assert cfg.logger.wandb_project == "megatron_training" and p.command()[0] == "torchrun"
    assert "--nproc-per-node=2" in p.command()
    shrunk = json.loads((Path(p.run_dir) / "shrunk.json").read_text())
    assert shrunk["replaced"] == "HybridModelProvider" and shrunk["model"] == "HybridModelProvider"  # Nano's family
    assert shrunk["copied"]["recompute_granularity"] == "full" and shrunk["copied"]["seq_length"] == SEQ
    assert shrunk["copied"]["moe_permute_fusion"] is True and shrunk["copied"]["expert_model_parallel_size"] == 2
    assert shrunk["copied"]["moe_token_dispatcher_type"] == "alltoall" and p.preflight.layout.ep == 2


def test_finetune_runs_saves_and_completes(finetuned):
    """Bridge's finetune() (the engine's run_training with pretrain=False) runs the 4 steps on both ranks, loads the
    pretrained checkpoint, and completes with TRAINING_DONE and a checkpoint at step 4; W&B wrote an offline run of
    the quickstart's project and name, and TensorBoard its events in the run directory."""
    (r,) = finetuned["runs"]["straight"]
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-6000:]
    run = Path(finetuned["plans"]["straight"].run_dir)
    assert (run / "TRAINING_DONE").exists() and (run / "checkpoints" / "TRAINING_DONE").exists()
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert json.loads((run / "metrics_summary.json").read_text())["status"] == "completed"
    progress = lines(run / "progress.ndjson")
    assert [x["step"] for x in progress] == list(range(1, ITERS + 1))
    assert all(0 < x["loss"] < 50 for x in progress), progress
    assert [x["tokens"] for x in progress] == [GBS * SEQ * s for s in range(1, ITERS + 1)]
    [wb] = wandb_offline_runs(run / "wandb")
    assert (wb["project"], wb["name"]) == ("megatron_training", "nemotron_nano_quickstart_sft"), wb
    # TensorBoard's events in the run directory (the quickstart names no folder): not the recipes' default,
    # ./nemo_experiments/default/tb_logs in the job's working directory (here the checkout, as on the cluster)
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert not (ROOT / "nemo_experiments").exists()


def test_a_stopped_run_resumes_with_the_losses_of_an_uninterrupted_one(finetuned):
    """Megatron's exit_interval stops the run at step 2 with a save (recorded as a stop for the requeue); the relaunch
    loads that save and runs steps 3-4; every step's loss equals the uninterrupted run's."""
    first, second = finetuned["runs"]["resumed"]
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    assert second.returncode == 0, (second.stdout + second.stderr)[-6000:]
    assert finetuned["after_stop"] == {"summary": finetuned["after_stop"]["summary"], "tracker": str(STOP_AT)}
    assert finetuned["after_stop"]["summary"]["status"] == "preempted"
    run = Path(finetuned["plans"]["resumed"].run_dir)
    assert f"successfully loaded checkpoint from {run / 'checkpoints'}" in second.stdout + second.stderr
    resumed = lines(run / "progress.ndjson")
    straight = lines(Path(finetuned["plans"]["straight"].run_dir) / "progress.ndjson")
    assert [x["step"] for x in resumed] == list(range(1, ITERS + 1))
    assert [x["loss"] for x in resumed] == [x["loss"] for x in straight], (resumed, straight)
    assert (run / "TRAINING_DONE").exists()


def test_packed_attention_equals_each_document_alone(tmp_path, harness_venv):
    """The training stand-in's one [kernel] for packed data: megatron-core's DotProductAttention given THD input with
    cu_seqlens (TE's fused attention on the cluster) equals the same attention run on each document alone, over each
    document's real tokens, with padding slots between documents as pad_seq_to_mult makes; attending across the
    boundary would differ by far more."""
    out = tmp_path / "packed_attention.json"
    r = tier_run([str(VENV / "bin" / "python"), str(HERE / "worker.py"), "packed-attention", str(out)],
                 env=tier_env({"MEGATRON_CPU_TRAINING": "1"}))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert max(got["diffs"]) < 1e-5 and got["across"] > 0.1, got


def test_the_packed_documents_reach_the_model_with_their_boundaries(finetuned):
    """What Bridge's GPT step hands the model for each rank's first micro-batch is one of our packs (the Parquet our
    data pipeline wrote), with one cu_seqlens segment per document at our document starts (each document's inputs
    one token shorter than its stored tokens: the next-token shift) plus the padding's own, and our loss mask;
    the packed-attention stand-in then attends within those segments only."""
    import pyarrow.parquet as pq

    packs = pq.read_table(finetuned["prepared"]["pack"]["paths"]["train"]).to_pylist()
    run = Path(finetuned["plans"]["straight"].run_dir)
    for rank in (0, 1):
        batch = json.loads((run / f"first_batch_rank{rank}.json").read_text())
        cu = batch["packed"]["cu_seqlens_q_padded"]
        assert len(batch["tokens"]) == SEQ and cu[0] == 0 and cu[-1] == SEQ, batch["packed"]
        found = [p for p in packs if p["input_ids"][:p["seq_start_id"][1] - 1] == batch["tokens"][:cu[1]]]
        assert found, f"rank {rank}: the first micro-batch is none of our packs"
        pack = found[0]
        starts = [*pack["seq_start_id"], len(pack["input_ids"])]
        assert len(starts) - 1 >= 2, "a pack of one document proves no boundary"
        for i in range(len(starts) - 1):
            s, e, p = starts[i], starts[i + 1], cu[i]
            assert cu[i + 1] - p == e - s - 1 and (p % PAD == 0), (i, cu, starts)
            assert batch["tokens"][p:p + e - s - 1] == pack["input_ids"][s:e - 1], i
            assert batch["loss_mask"][p:p + e - s - 1] == pack["loss_mask"][s:e - 1], i
        assert 0 < sum(batch["loss_mask"]) < SEQ
