"""The container path for real: Charliecloud with a Debian image that the env pipeline builds (debootstrap).
Needs root (debootstrap) and the Debian package registry; skipped with the reason otherwise."""

import os
import shutil

import pytest

from tests.helpers import ROOT, run
from tests.tiers import tier_unavailable

pytestmark = [pytest.mark.charliecloud, pytest.mark.slow]


@pytest.fixture(scope="module")
def ch_env(tmp_path_factory):
    if os.geteuid() != 0:
        tier_unavailable("charliecloud", "building the Charliecloud image needs root (debootstrap)")
    image = tmp_path_factory.mktemp("ch") / "debian-bookworm"
    env = {**os.environ, "PIPELINE_RUNTIME": "charliecloud", "PIPELINE_CH_IMAGE": str(image), "USER": "root",
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    res = run(["bash", "pipeline_env_setup.sh"], env=env, timeout=900)
    if res.returncode != 0 and ("debootstrap" in res.stderr and "failed" in res.stderr.lower()):
        tier_unavailable("charliecloud", "cannot build the Debian image here: "
                         + (res.stderr.strip().splitlines() or ["?"])[-1])
    return env, image, res


def test_setup_builds_and_validates_inside_the_container(ch_env):
    env, image, res = ch_env
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "step image: running" in out and (image / "bin" / "bash").exists()
    assert "PASS runtime: charliecloud (inside the charliecloud container)" in out
    assert "PASS container-image" in out and "SKIP gpu-visible" in out and "0 failed" in out
    again = run(["bash", "pipeline_env_setup.sh"], env=env, timeout=600)
    assert again.returncode == 0
    for step in ("venv", "packages", "assets", "image"):
        assert f"step {step}: already done, skipping" in again.stderr
    forced = run(["bash", "pipeline_env_setup.sh", "--force", "--only", "image"], env=env, timeout=900)
    assert forced.returncode == 0 and "step image: running" in forced.stderr


def test_exec_gives_the_same_result_in_venv_and_container(ch_env):
    env, _, _ = ch_env
    cmd = ("source pipeline_env_activate.sh && python -c \"import torch, transformers, pipeline; "
           "print(torch.__version__, transformers.__version__, sum(range(10)))\"")
    inside = run(["bash", "pipeline_env_exec.sh", cmd], env=env)
    host = run(["bash", "pipeline_env_exec.sh", cmd], env={**env, "PIPELINE_RUNTIME": "venv"})
    assert inside.returncode == host.returncode == 0, inside.stderr + host.stderr
    assert inside.stdout == host.stdout and inside.stdout.strip()
    where = run(["bash", "pipeline_env_exec.sh", "echo $PIPELINE_IN_CONTAINER"], env=env)
    assert where.stdout.strip() == "charliecloud"


def test_removing_the_image_fails_the_launcher_with_the_rebuild_command(ch_env, tmp_path):
    env, image, _ = ch_env
    moved = tmp_path / "moved"
    shutil.move(str(image), moved)
    try:
        res = run(["bash", "pipeline_training_launch.sh", "configs/local/tiny_moe_sft.yaml", "--model",
                   "tiny-qwen3-moe", "--mode", "sft"], env=env, timeout=60)
        assert res.returncode == 1
        assert f"container image {image} is missing; build it with: bash {ROOT}/pipeline_env_setup.sh --only image" \
            in res.stderr
    finally:
        shutil.move(str(moved), image)
