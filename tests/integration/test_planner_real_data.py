"""The login node as a cluster user has it (issue 49, item 1): the planner alone on the path (the env setup's planner
step builds it: no venv, no torch), the reference's packed data and base checkpoint present on the reference's
paths (under a temporary root standing for /projects/a5k/public, bound into the container by PIPELINE_BINDS), and
no --no-path-checks: the planner reads the packed Parquet and its metadata, as the preflight does on the cluster.
Before this, the planner had neither pyarrow nor orjson, and once the data existed every such plan was refused
("create the planner with ...") or ended in a traceback (ModuleNotFoundError: orjson)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.data import packed_parquet
from tests.helpers import ROOT, image_record, run
from tests.unit.test_preflight_packed import write_packs  # the data pipeline's own writer, as the preflight reads it

pytestmark = pytest.mark.slow

CONFIG = "configs/quickstart/nemotron_nano_quickstart_sft.yaml"
TOK = "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
DATASET = "geodesic-research/pa-warm-start-1B-sft-mix"
SEQ, PAD, ROWS = 32768, 16, 128  # test_preflight_packed.write_packs: a global batch (128) of packs of 32K, pad 16


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    """The planner, made by the env setup's own step (pip from the registries, pinned by requirements/planner.txt)."""
    base = tmp_path_factory.mktemp("login")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(base), "PIPELINE_CLUSTER": "isambard_gh200",
           "PIPELINE_PLANNER_PYTHON": f"python3.{sys.version_info.minor}",
           "PIPELINE_PLANNER_VENV": str(base / "planner"), "PIPELINE_CONTAINER_DIR": str(base / "shared")}
    made = run(["bash", "pipeline_env_setup.sh", "--only", "planner"], env=env, timeout=900)
    assert made.returncode == 0, made.stderr[-3000:]
    assert not list((base / "planner").glob("lib/python*/site-packages/torch"))
    return base, env


@pytest.fixture
def login(planner, tmp_path):
    """The reference's shared folders under a temporary root: the packed data of Step 1 and the imported base of
    Step 2 where the quickstart config reads them; the root is bound into the container (PIPELINE_BINDS)."""
    base, env = planner
    public = tmp_path / "projects" / "a5k" / "public"
    data = public / "data" / DATASET.replace("/", "__")
    base_ckpt = public / "checkpoints" / "megatron_bridges" / "models" / "NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16"
    (base_ckpt / "iter_0000000").mkdir(parents=True)
    (base_ckpt / "iter_0000000" / "common.pt").write_bytes(b"x")
    (base_ckpt / "latest_checkpointed_iteration.txt").write_text("0")
    write_packs(data)
    sif = public / "containers" / "nemo-26.06.sif"
    image_record(sif)  # validate's record of the image (the env pipeline's step before training)
    env = {**env, "PIPELINE_BINDS": str(tmp_path / "projects"), "PIPELINE_VENV": str(base / "no-venv"),
           "PIPELINE_SIF": str(sif),
           "PIPELINE_RUNS_DIR": str(tmp_path / "runs"), "PIPELINE_LOG_DIR": str(tmp_path / "logs")}
    paths = [f"dataset.dataset_root={data}", f"checkpoint.pretrained_checkpoint={base_ckpt}",
             f"checkpoint.save={public / 'checkpoints' / 'megatron' / 'nemotron_nano_quickstart_sft'}",
             f"logger.wandb_save_dir={public / 'logs' / 'wandb'}"]
    return env, paths, data


def no_venv_python(env) -> None:
    """Nothing of the test venv is reachable: python3 is the machine's, and it cannot import the suite's needs."""
    probe = subprocess.run(["python3", "-c", "import pyarrow"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0, "the machine's python3 has pyarrow: this would not be the login node"


def test_the_quickstart_plans_on_the_planner_alone_with_the_data_present(login):
    env, paths, _ = login
    no_venv_python(env)
    res = run(["bash", "pipeline_training_launch.sh", CONFIG, "--model", "nano", "--mode", "sft", "--dry-run",
               "--nodes", "16", *paths], env=env, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "create the planner" not in out
    assert f"data: {ROWS} packs of {SEQ} tokens" in out, out[-3000:]
    assert "== preflight: PASS ==" in out and "path checks skipped" not in out


def test_a_truncated_pack_is_refused_in_one_line_by_the_planner(login):
    """The planner reads the packed file the config names: a truncated one is refused at plan time, in one line."""
    env, paths, data = login
    (packed_parquet.packed_paths(data, TOK, PAD, SEQ)["train"]).write_bytes(b"PAR1")
    res = run(["bash", "pipeline_training_launch.sh", CONFIG, "--model", "nano", "--mode", "sft", "--dry-run",
               "--nodes", "16", *paths], env=env, timeout=300)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(errors) == 1 and f"training_{SEQ}.idx.parquet" in errors[0], errors


def test_the_data_prepare_plan_runs_on_the_planner(login):
    """Step 1's dry run (the packed path the quickstart config reads) on the planner: a plan, not a traceback."""
    env, _, data = login
    res = run(["python3", "pipeline_data_prepare.py", "prepare", "--dataset", DATASET, "--seq-length", str(SEQ),
               "--model", "nano", "--dry-run", "--dataset-root", str(data)], env=env, timeout=300)
    out = res.stdout + res.stderr
    assert "Traceback" not in out and "ModuleNotFoundError" not in out, out[-3000:]
    assert res.returncode == 0, out[-3000:]
    assert re.search(rf"packed/{TOK}_pad_seq_to_mult{PAD}/training_{SEQ}\.idx\.parquet", out), out[-3000:]


@pytest.fixture
def corpus(login, tmp_path):
    """The reference's indexed pretraining corpus where its cluster configs name it, written by the data pipeline's
    own tokenize (a small real corpus; the planner checks the .bin/.idx pair, Bridge reads it on the cluster)."""
    from pipeline.data.indexed import tokenize_corpus

    env, _, _ = login
    public = tmp_path / "projects" / "a5k" / "public"
    texts = tmp_path / "corpus.jsonl"
    texts.write_text("".join(f'{{"text": "document {i}: the quick brown fox jumps over the lazy dog."}}\n'
                             for i in range(64)))
    out = public / "data" / "pretrain" / "tokenized"
    tokenize_corpus(str(texts), "smollm2-135m", out, "text", quiet=True, workers=1)
    prefix = out / "text_text_document"
    assert prefix.with_suffix(".bin").is_file() and prefix.with_suffix(".idx").is_file()
    base_ckpt = public / "checkpoints" / "megatron_bridges" / "models" / "NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16"
    save = public / "checkpoints" / "megatron" / "me"
    return env, prefix, base_ckpt, save


@pytest.mark.parametrize("config,mode", [("configs/cluster_runs/nemotron_nano_pretrain.yaml", "pretrain"),
                                         ("configs/cluster_runs/nemotron_nano_cpt.yaml", "cpt")])
def test_the_cluster_pretraining_configs_plan_with_path_checks_on(corpus, config, mode):
    """Issue 59, item 2: the commands in the shipped pretraining and CPT configs' headers, planned by the planner
    alone with path checks on: before, the preflight demanded dataset.dataset_root, and naming it was refused as
    not a field of GPTDatasetConfig. The corpus is named as the headers say (+dataset.data_path=[PREFIX])."""
    env, prefix, base_ckpt, save = corpus
    no_venv_python(env)
    extra = [f"checkpoint.pretrained_checkpoint={base_ckpt}"] if mode == "cpt" else []
    res = run(["bash", "pipeline_training_launch.sh", config, "--model", "nano", "--mode", mode, "--dry-run",
               "--nodes", "16", f"+dataset.data_path=[{prefix}]", f"checkpoint.save={save / mode}", *extra],
              env=env, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "== preflight: PASS ==" in out and "path checks skipped" not in out and "dataset_root" not in out, out
    # a missing corpus is still refused, naming the prefix and the command that writes it
    res = run(["bash", "pipeline_training_launch.sh", config, "--model", "nano", "--mode", mode, "--dry-run",
               "--nodes", "16", f"+dataset.data_path=[{prefix}x]", f"checkpoint.save={save / mode}", *extra],
              env=env, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"dataset.data_path prefix {prefix}x has no .bin or .idx file: write it with pipeline_data_prepare.py " \
           "tokenize" in res.stderr, res.stderr


def _cluster_experiment(tmp_path, public) -> Path:
    """The shipped cluster experiment with the reference's /projects/a5k/public standing at the test's root (the
    only change: every path in it is under that root)."""
    text = (ROOT / "configs" / "experiments" / "nano_pretrain_cooldown.yaml").read_text()
    assert "/projects/a5k/public/" in text
    exp = tmp_path / "experiments" / "nano_pretrain_cooldown.yaml"
    exp.parent.mkdir(parents=True, exist_ok=True)
    exp.write_text(text.replace("/projects/a5k/public", str(public)))
    return exp


def test_the_cluster_experiment_chain_plans_whole_on_the_planner(corpus, tmp_path):
    """Issue 59, items 2, 6 and 7: the shipped Isambard experiment (Nano pretrain -> cooldown -> export -> coherence)
    rendered by the planner alone with path checks on and the corpus present: every phase planned, no problem, each
    training phase saving into its own folder from ${exp.name}/${exp.label}/${exp.phase}, the cooldown continuing
    the pretrain's last checkpoint and the export reading the cooldown's."""
    env, prefix, _, _ = corpus
    no_venv_python(env)
    public = tmp_path / "projects" / "a5k" / "public"
    exp = _cluster_experiment(tmp_path, public)
    env = {**env, "USER": "pipeline-alice"}
    res = run(["python3", "pipeline_experiment.py", "render", str(exp), "--no-configs"], env=env, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert "submit refuses" not in out and "problem(s)" not in out, out[-3000:]
    jobs = [ln for ln in res.stdout.splitlines() if ln.startswith("JOB_")]
    assert [ln.rsplit("# ", 1)[1] for ln in jobs] == ["pretrain", "cooldown", "export", "coherence"], jobs
    save = public / "checkpoints" / "megatron" / "pipeline-alice" / "nano_pretrain_cooldown" / "base"
    assert f"checkpoint.save={save / 'pretrain'} " in jobs[0] and f"+dataset.data_path=[{prefix}]" in jobs[0], jobs[0]
    assert f"checkpoint.save={save / 'cooldown'} checkpoint.load={save / 'pretrain'} checkpoint.ckpt_step=1000 " \
           "train.train_iters=1200 " in jobs[1], jobs[1]
    assert f"export {save / 'cooldown'} " in jobs[2] and "--iteration 1200" in jobs[2], jobs[2]
    assert f"{save / 'cooldown' / 'iter_0001200' / 'hf'})" in jobs[3], jobs[3]


def test_isambard_sbatch_dry_run_prints_the_sbatch_line_and_queues_nothing(corpus, tmp_path):
    """Issue 59, item 5: `isambard_sbatch --dry-run` on the login node (the planner alone): the preflight runs, the
    exact sbatch command comes out on stdout (the bad-node --exclude, the profile's --gpus-per-node and --exclusive,
    the run's job name) and nothing reaches sbatch (a tripwire sbatch first on PATH would leave its mark). A broken
    job is refused by the dry run as by the submission."""
    env, prefix, _, save = corpus
    trip = tmp_path / "tripwire"
    trip.mkdir()
    # (the option parser asks sbatch --help/--usage which options take values: that queues nothing)
    (trip / "sbatch").write_text('#!/bin/sh\ncase "$1" in --help|--usage) exit 0;; esac\n'
                                 f'echo "$@" >> {tmp_path}/sbatch-called\nexit 1\n')
    (trip / "sbatch").chmod(0o755)
    env = {**env, "PATH": f"{trip}:{env['PATH']}", "BAD_NODES_LOG": str(tmp_path / "bad_nodes.txt")}
    assert run(["./isambard_sbatch", "--mark-bad", "nid000002", "GPU ECC (Xid 48)"], env=env).returncode == 0
    cmd = ["./isambard_sbatch", "--dry-run", "--nodes=16", "pipeline_training_submit.sbatch",
           "configs/cluster_runs/nemotron_nano_pretrain.yaml", "nano", "pretrain", f"+dataset.data_path=[{prefix}]",
           f"checkpoint.save={save / 'dry'}"]
    res = run(cmd, env=env, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sbatch "), res.stdout
    words = lines[0].split()
    for want in ("--nodes=16", "--exclude=nid000002", "--gpus-per-node=4", "--exclusive",
                 "--job-name=training-nemotron_nano_pretrain", "pipeline_training_submit.sbatch"):
        assert want in words, (want, words)
    assert "--dry-run" not in words
    assert "dry run: nothing was queued" in res.stderr and "Preflight: PASS - world 64 " in res.stderr
    res = run([*cmd[:-2], f"+dataset.data_path=[{prefix}x]", cmd[-1]], env=env, timeout=300)
    assert res.returncode == 2 and res.stdout.strip() == "", res.stdout + res.stderr
    assert "has no .bin or .idx file" in res.stderr
    assert not (tmp_path / "sbatch-called").exists()


def test_a_tokenize_across_nodes_dry_run_says_how_the_corpus_is_split(login, tmp_path):
    """Issue 64: `isambard_sbatch --dry-run --nodes=4 pipeline_data_submit.sbatch tokenize ...` on the planner alone,
    a corpus of several hundred files on the shared filesystem: the split (each shard's files and folder, then the
    merge) is printed and nothing is queued."""
    env, _, _ = login
    no_venv_python(env)
    corpus = tmp_path / "projects" / "a5k" / "public" / "data" / "web"
    corpus.mkdir(parents=True)
    for i in range(400):
        (corpus / f"part-{i:05d}.jsonl").write_text(f'{{"text": "{"word " * (i % 37 + 1)}"}}\n' * (i % 5 + 1))
    env = {**env, "BAD_NODES_LOG": str(tmp_path / "bad_nodes.txt")}
    res = run(["./isambard_sbatch", "--dry-run", "--nodes=4", "pipeline_data_submit.sbatch", "tokenize", str(corpus),
               "nano", "web"], env=env, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "tokenize across 4 nodes: 400 file(s)" in res.stderr, res.stderr
    shards = re.findall(r"shard (\d)/4: (\d+) file\(s\), [\d.]+ \w+ \((part-\d+\.jsonl) \.\. (part-\d+\.jsonl)\) -> "
                        r"(\S+)", res.stderr)
    assert [s[0] for s in shards] == ["0", "1", "2", "3"] and sum(int(s[1]) for s in shards) == 400, res.stderr
    assert shards[0][2] == "part-00000.jsonl" and shards[-1][3] == "part-00399.jsonl"
    assert shards[1][4] == str(corpus / "web" / ".shards" / "shard_00001_of_00004")
    assert f"then the merge: {corpus / 'web' / 'web_text_document'}.{{bin,idx}}" in res.stderr
    assert res.stdout.split() == ["sbatch", "--nodes=4", "--exclusive", "--gpus-per-node=4",
                                  "pipeline_data_submit.sbatch", "tokenize", str(corpus), "nano", "web"], res.stdout


def test_a_chat_prepare_across_nodes_dry_run_says_how_it_is_split(login, tmp_path):
    """Issue 64 step 4: `isambard_sbatch --dry-run --nodes=3 pipeline_data_submit.sbatch prepare ...` on the planner
    alone, a chat JSONL on the shared filesystem: the plan (the export on one node, each shard's folder, the merge and
    the pack) is printed and nothing is queued; the job's own step options given by hand are refused in one line."""
    env, _, _ = login
    no_venv_python(env)
    public = tmp_path / "projects" / "a5k" / "public" / "data"
    chat = public / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n' * 50)
    root = public / "chat_prepared"
    env = {**env, "BAD_NODES_LOG": str(tmp_path / "bad_nodes.txt")}
    argv = ["pipeline_data_submit.sbatch", "prepare", "--dataset", str(chat), "--seq-length", "4096", "--model",
            "nano", "--dataset-root", str(root)]
    res = run(["./isambard_sbatch", "--dry-run", "--nodes=3", *argv], env=env, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"prepare across 3 nodes: the export of {chat} on one node into {root}" in res.stderr, res.stderr
    for i in range(3):
        assert f"  shard {i}/3 -> {root / '.shards' / f'shard_0000{i}_of_00003' / 'tokenized'}" in res.stderr
    assert f"then the merge and the pack on one node into {root / 'packed'}" in res.stderr
    assert res.stdout.split() == ["sbatch", "--nodes=3", "--exclusive", "--gpus-per-node=4", *argv], res.stdout
    res = run(["./isambard_sbatch", "--dry-run", "--nodes=3", *argv, "--shard", "0/3"], env=env, timeout=300)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 2 and len(errors) == 1 and "the job's own steps" in errors[0], res.stderr
