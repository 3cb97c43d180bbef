"""The preflight reads the packed file the config names (issue 33 item 2): a 0-byte, truncated, empty or mismatched
packed Parquet is one line at plan time, not a crash on the GPU node after the queue."""

import json

import numpy as np
import pytest

from pipeline.cli.train import main
from pipeline.data import packed_parquet
from tests.helpers import image_record

NANO = "configs/quickstart/nemotron_nano_quickstart_sft.yaml"
TOK = "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
SEQ, PAD = 32768, 16
GBS = 128  # the quickstart's train.global_batch_size: Megatron Bridge refuses fewer packs


def argv(root, ckpt):
    return [NANO, "--model", "nano", "--mode", "sft", "--disable-ft", "--dry-run", "--nodes", "16",
            f"dataset.dataset_root={root}", f"checkpoint.pretrained_checkpoint={ckpt}"]


def errors(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def write_packs(root, rows=GBS, pack_size=SEQ, pad=PAD, split="train"):
    paths = packed_parquet.packed_paths(root, TOK, PAD, SEQ)
    paths["train"].parent.mkdir(parents=True, exist_ok=True)
    n = 8
    offsets = np.arange(rows + 1, dtype=np.int64) * n
    table = packed_parquet.packs_table(offsets, np.ones(rows * n, np.int64), np.ones(rows * n, np.int8),
                                       np.arange(rows + 1, dtype=np.int64), np.zeros(rows, np.int64))
    packed_parquet.write([table], paths[split])
    paths["metadata"].write_text(json.dumps([{"pack_size": pack_size, "packing_factor": 1.0}]))
    (paths["train"].parent / f"{SEQ}_summary.json").write_text(json.dumps({"fingerprint": {"pad_seq_to_mult": pad}}))
    return paths


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_BINDS", str(tmp_path))  # the container sees them (binds: decisions #55)
    monkeypatch.setenv("PIPELINE_SIF", str(tmp_path / "nemo.sif"))  # with validate's record of what it holds
    image_record(tmp_path / "nemo.sif")
    root, ckpt = tmp_path / "data", tmp_path / "ckpt"
    root.mkdir()
    (ckpt / "iter_0000000").mkdir(parents=True)  # an imported base: a tracker and its iteration
    (ckpt / "iter_0000000" / "common.pt").write_bytes(b"x")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("0")
    return root, ckpt


@pytest.mark.parametrize("made", ["empty", "empty iteration", "tracker only"])
def test_a_base_checkpoint_folder_that_holds_no_checkpoint_is_one_line(capsys, dirs, made):
    """Issue 49 item 9: an empty pretrained_checkpoint folder (or one whose only iteration folder is empty: an import
    that never finished) passed the preflight and failed on every rank after the queue."""
    write_packs(dirs[0])
    base = dirs[1].parent / "base"
    base.mkdir()
    if made == "empty iteration":
        (base / "iter_0000000").mkdir()
    if made == "tracker only":  # a tracker is what Bridge reads first: its own check names a missing iteration
        (base / "latest_checkpointed_iteration.txt").write_text("0")
    rc = main(argv(dirs[0], base))
    errs = errors(capsys)
    assert rc == 2 and len(errs) == 1, errs
    want = "names iteration 0" if made == "tracker only" else f"checkpoint {base} holds no Megatron checkpoint"
    assert want in errs[0] or (made == "tracker only" and "iter_0000000 does not exist" in errs[0]), errs


def test_good_packs_pass_and_are_counted(capsys, dirs):
    write_packs(dirs[0])
    assert main(argv(*dirs)) == 0
    assert f"data: {GBS} packs of {SEQ} tokens" in capsys.readouterr().out


def test_a_zero_byte_packed_file_is_one_line(capsys, dirs):
    paths = write_packs(dirs[0])
    paths["train"].write_bytes(b"")
    assert main(argv(*dirs)) == 2
    errs = errors(capsys)
    assert len(errs) == 1 and f"packed training data {paths['train']} is empty (0 bytes)" in errs[0]


def test_a_truncated_packed_file_is_one_line(capsys, dirs):
    paths = write_packs(dirs[0])
    data = paths["train"].read_bytes()
    paths["train"].write_bytes(data[: len(data) // 2])
    assert main(argv(*dirs)) == 2
    errs = errors(capsys)
    assert len(errs) == 1 and "is not a readable Parquet file" in errs[0] and "--force" in errs[0]


def test_a_packed_file_without_rows(capsys, dirs):
    write_packs(dirs[0], rows=0)
    assert main(argv(*dirs)) == 2
    assert any("has no rows" in e for e in errors(capsys))


@pytest.mark.parametrize("kw,needle", [
    ({"pack_size": 4096}, f"says pack_size 4096 but the config's sequence length is {SEQ}"),
    ({"pad": 4}, "were made with pad_seq_to_mult 4"),
])
def test_metadata_that_disagrees_with_the_config(capsys, dirs, kw, needle):
    write_packs(dirs[0], **kw)
    assert main(argv(*dirs)) == 2
    errs = errors(capsys)
    assert len(errs) == 1 and needle in errs[0]


def test_missing_metadata(capsys, dirs):
    paths = write_packs(dirs[0])
    paths["metadata"].unlink()
    assert main(argv(*dirs)) == 2
    assert any(f"packing metadata {paths['metadata']} does not exist" in e for e in errors(capsys))


def test_fewer_training_packs_than_one_global_batch_is_one_line(capsys, dirs):
    """Issue 58: Megatron Bridge's loader raises "Not enough train samples for a single global batch" on every rank,
    after the queue and the model's load (found by the megatron_cpu tier's finetune() of the quickstart)."""
    paths = write_packs(dirs[0], rows=GBS - 1)
    assert main(argv(*dirs)) == 2
    assert errors(capsys) == [f"error: packed training data {paths['train']} holds {GBS - 1} packs, fewer than one "
                              f"global batch (train.global_batch_size={GBS}): Megatron Bridge refuses it; prepare more "
                              "data or lower train.global_batch_size"]
    assert main([*argv(*dirs), f"train.global_batch_size={GBS // 2}"]) == 0


def test_a_validation_split_smaller_than_one_global_batch_is_one_line(capsys, dirs):
    """Issue 58: Bridge evaluates with the training batch and drops a partial one: a validation split of fewer packs
    failed its first evaluation, after the training steps had run. Not validating is the other way out."""
    write_packs(dirs[0])
    paths = write_packs(dirs[0], rows=15, split="validation")
    assert main(argv(*dirs)) == 2
    [err] = errors(capsys)
    assert err.startswith(f"error: packed validation data {paths['validation']} holds 15 packs, fewer than one global "
                          f"batch (train.global_batch_size={GBS}, what Megatron Bridge evaluates with)"), err
    assert main([*argv(*dirs), "dataset.do_validation=false"]) == 0
    write_packs(dirs[0], split="validation")
    assert main(argv(*dirs)) == 0


def test_an_image_without_its_package_record_is_one_line(capsys, dirs, tmp_path):
    """Issue 58 item 4: the hybrid family's recipes need mamba-ssm and causal-conv1d (and Nano's DeepEP for its flex
    dispatcher); the first Nano run failed in MambaMixer.__init__ on every rank after the allocation. The preflight
    reads validate's record of the image; without one it says how to make it."""
    write_packs(dirs[0])
    record = tmp_path / "nemo.sif.packages.txt"
    record.unlink()
    assert main(argv(*dirs)) == 2
    assert errors(capsys) == [f"error: the image's package record {record} does not exist: the nano sft recipe needs "
                              "transformer-engine, mamba-ssm, causal-conv1d, deep-ep; record what the image holds "
                              "with isambard_sbatch pipeline_env_submit.sbatch validate (its image-packages check "
                              "writes it)"]


def test_an_image_that_lacks_a_package_of_the_recipe_is_one_line(capsys, dirs, tmp_path):
    write_packs(dirs[0])
    sif = tmp_path / "nemo.sif"
    image_record(sif, ("transformer_engine==2.14.0", "Mamba_SSM==2.3.2.post1", "deep_ep==1.2.1"))  # names as pip
    assert main(argv(*dirs)) == 2
    [err] = errors(capsys)
    assert err.startswith(f"error: the image {sif} lacks causal-conv1d (its record {sif}.packages.txt): the nano "
                          "sft recipe needs"), err
    # alltoall in the config: DeepEP is no longer needed (and its absence not refused)
    image_record(sif, ("transformer-engine==2.14.0", "mamba-ssm==2.3.2.post1", "causal-conv1d==1.7.0"))
    assert main([*argv(*dirs), "model.moe_token_dispatcher_type=alltoall"]) == 0
    assert main(argv(*dirs)) == 2 and "lacks deep-ep" in errors(capsys)[0]
    # the venv runtime (no image) and --no-path-checks read no record
    assert main([*argv(*dirs), "--no-path-checks"]) == 0


@pytest.mark.parametrize("made", ["fifo", "folder", "huge"])
def test_an_image_record_that_is_no_package_list_is_one_line(capsys, dirs, tmp_path, made):
    """A FIFO as the record would block the login node's planner for ever; a folder or a file over the cap is one line
    too."""
    import os

    write_packs(dirs[0])
    record = tmp_path / "nemo.sif.packages.txt"
    record.unlink()
    if made == "fifo":
        os.mkfifo(record)
    elif made == "folder":
        record.mkdir()
    else:
        with record.open("wb") as f:
            f.truncate(5 * 2**20)  # sparse: no memory, no disk
    assert main(argv(*dirs)) == 2
    [err] = errors(capsys)
    assert err.startswith(f"error: the image's package record {record} is "), err


def test_the_distributed_optimizer_on_an_image_without_a_fused_adam_is_one_line(capsys, dirs, tmp_path):
    """Issue 62: megatron-core's DistributedOptimizer on torch's Adam (no TE, no Apex in the image) trains and saves,
    then dies on its first resume; the plan says so, in its own line, and not when the config turns it off or the
    image has Apex."""
    write_packs(dirs[0])
    sif = tmp_path / "nemo.sif"
    image_record(sif, ("mamba-ssm==2.3.2.post1", "causal-conv1d==1.7.0", "deep-ep==1.2.1"))
    assert main(argv(*dirs)) == 2
    lacks, optimizer = errors(capsys)
    assert lacks.startswith(f"error: the image {sif} lacks transformer-engine"), lacks
    assert optimizer.startswith("error: the distributed optimizer (optimizer.use_distributed_optimizer, on in "
                                f"Bridge's recipes) with neither Transformer Engine nor Apex in the image {sif}"), optimizer
    assert "cannot resume (distrib_optimizer.py:839)" in optimizer
    off = ["optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false"]
    assert main([*argv(*dirs), *off]) == 2 and [e[:30] for e in errors(capsys)] == [lacks[:30]]
    image_record(sif, ("apex==0.1", "mamba-ssm==2.3.2.post1", "causal-conv1d==1.7.0", "deep-ep==1.2.1"))
    assert main(argv(*dirs)) == 2 and [e[:30] for e in errors(capsys)] == [lacks[:30]]


def test_a_venv_job_with_the_distributed_optimizer_is_told_what_its_resume_needs(dirs, monkeypatch):
    """A venv job's packages are not visible from the login node: the plan notes what the distributed optimizer's
    resume needs there, and nothing once the config turns it off."""
    from pathlib import Path

    from pipeline.cli.train import plan_from_argv

    monkeypatch.setenv("PIPELINE_CLUSTER", str(Path(__file__).parents[1] / "megatron_cpu" / "cluster_cpu_ranks.yaml"))
    write_packs(dirs[0])
    note = "resumes only where the job's venv has Transformer Engine or Apex (not inspected from here)"
    assert any(note in n for n in plan_from_argv(argv(*dirs)).preflight.notes)
    off = ["optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false"]
    assert not any(note in n for n in plan_from_argv([*argv(*dirs), *off]).preflight.notes)
