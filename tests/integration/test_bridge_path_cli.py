"""The Megatron Bridge path's commands run for real (CPU): import on one node, a rank per GPU for a model-parallel
export, the cluster container in validate (moved from tests/unit/test_bridge_path.py: these tests run the scripts)."""

import json
import os

from pipeline.common import layout
from tests.helpers import ROOT, run
from tests.unit.test_bridge_path import megatron_iters

PY = str(ROOT / ".venv/bin/python")


def _tiny_safetensors(path):
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, 2)}, str(path))


def test_import_runs_on_one_node(pipeline_env, tmp_path):
    """Bridge's single-process import builds the model once, on one host: for Nano a multi-node allocation is
    refused with the one-node command; on one node, `import nano` fetches the -Base-BF16 model its config reads.
    Super imports under torchrun on the allocation's nodes."""
    env = {**pipeline_env, "PYTHONPATH": str(ROOT / "src"), "PIPELINE_CLUSTER": "isambard_gh200",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "nid[001-004]", "SLURM_NODEID": "2"}
    res = run([PY, "-m", "pipeline.cli.checkpoint", "import", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16",
               "--output", str(tmp_path / "out")], env=env)
    assert res.returncode == 2 and res.stderr == (
        "error: import runs on one node, and 4 were asked for: isambard_sbatch --nodes=1 "
        "pipeline_checkpoint_submit.sbatch import nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16\n")
    assert not (tmp_path / "out").exists()
    # Super: never one process (the reference: it hangs); on the reference's 4 nodes it plans torchrun on every GPU
    # (tp 1 pp 4 ep 4: decisions #83), and the launcher stops before starting any rank without Megatron Bridge
    res = run([PY, "-m", "pipeline.cli.checkpoint", "import", "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
               "--output", str(tmp_path / "out")], env=env)
    assert res.returncode == 2 and res.stderr.startswith(
        "error: importing nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 as a Megatron checkpoint needs") and \
        res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "out").exists()
    res = run([PY, "-m", "pipeline.cli.checkpoint", "import", "nano", "--output", str(tmp_path / "out")],
              env={**env, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "nid001", "SLURM_NODEID": "0"})
    assert res.returncode == 2 and res.stderr.startswith(
        "error: importing nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16 as a Megatron checkpoint needs")
    assert "cannot be imported here" in res.stderr and res.stderr.count("\n") == 1


def test_model_parallel_export_starts_one_rank_per_gpu(pipeline_env, tmp_path):
    megatron_iters(tmp_path)
    env = {**pipeline_env, "PYTHONPATH": str(ROOT / "src"), "PATH": f"{ROOT}/.venv/bin:{os.environ['PATH']}",
           "PIPELINE_CLUSTER": "isambard_gh200", "PIPELINE_BINDS": str(tmp_path)}  # bound: decisions #55
    plan = run([PY, "-m", "pipeline.cli.checkpoint", "export", str(tmp_path), "--hf-model", "x/y", "--no-reasoning",
                "--iteration", "200", "--tp", "2", "--ep", "2", "--dry-run", "--json"], env=env, timeout=300)
    assert json.loads(plan.stdout)["launch"] == [
        "torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2", "-m", "pipeline.cli.checkpoint", "export",
        str(tmp_path), "--hf-model", "x/y", "--no-reasoning", "--iteration", "200", "--tp", "2", "--ep", "2"]
    res = run([PY, "-m", "pipeline.cli.checkpoint", "export", str(tmp_path), "--hf-model", "x/y", "--no-reasoning",
               "--iteration", "200", "--tp", "1", "--ep", "2"], env=env, timeout=300)
    # Without Megatron Bridge (this machine) the launcher stops before starting any rank, with one line naming
    # exactly the requested iteration.
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"error: exporting the Megatron checkpoint {tmp_path}/iter_0000200 needs Megatron")
    local = tmp_path / "local"
    (layout.iter_dir(local, 10)).mkdir(parents=True)
    (layout.iter_dir(local, 10) / layout.MARKER).write_text('{"engine": "local"}')
    (layout.iter_dir(local, 10) / "config.json").write_text("{}")
    _tiny_safetensors(layout.iter_dir(local, 10) / "model.safetensors")
    layout.write_tracker(local, 10)
    res = run([PY, "-m", "pipeline.cli.checkpoint", "export", str(local), "--hf-model", "x/y", "--no-reasoning",
               "--tp", "2"], env=env)
    assert res.returncode == 2 and "apply to Megatron checkpoints" in res.stderr


def test_validate_knows_the_cluster_container(pipeline_env):
    """Inside the Apptainer image the local-venv checks are skipped with the reason and the GPU stack is checked.
    (Run on this CPU host with the container's marker set: the container's checks then fail, as they must.)"""
    env = {**pipeline_env, "PYTHONPATH": str(ROOT / "src"), "PIPELINE_IN_CONTAINER": "apptainer",
           "PIPELINE_RUNTIME": "apptainer"}
    res = run([PY, "-m", "pipeline.env.validate"], env=env, timeout=300)
    out = res.stdout
    for name in ("smollm2-package", "base-model-smollm2", "chat-corpus", "venv-active"):
        assert f"SKIP {name}: apptainer" in out, out
    assert "FAIL python-version: Python 3.11 in the container" in out
    assert "FAIL import-megatron-bridge" in out and "--only overlay" in out
    assert "SKIP ft-launcher" not in out and "ft-launcher: " in out and res.returncode == 1
    host = run([PY, "-m", "pipeline.env.validate", "--only", "import-megatron-bridge", "--only", "chat-corpus"],
               env={**pipeline_env, "PYTHONPATH": str(ROOT / "src")})
    assert "SKIP import-megatron-bridge: venv runtime" in host.stdout and "PASS chat-corpus" in host.stdout
