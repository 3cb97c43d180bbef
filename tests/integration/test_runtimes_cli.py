"""A missing container image fails the real training launcher at once, naming the fix (moved from
tests/unit/test_runtimes.py: this test runs the script)."""

import pytest

from tests.helpers import ROOT, run


@pytest.mark.parametrize("runtime,fix", [("apptainer", "--only pull"), ("charliecloud", "--only image")])
def test_missing_image_fails_the_training_launcher_at_once(tmp_path, pipeline_env, runtime, fix):
    env = {**pipeline_env, "PIPELINE_RUNTIME": runtime, "PIPELINE_SIF": str(tmp_path / "none.sif"),
           "PIPELINE_CH_IMAGE": str(tmp_path / "none")}
    res = run(["bash", "pipeline_training_launch.sh", "configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe",
               "--mode", "sft"], env=env, timeout=60)
    assert res.returncode == 1
    assert f"bash {ROOT}/pipeline_env_setup.sh {fix}" in res.stderr
