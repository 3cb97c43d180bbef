"""Coherence runs in W&B are named by model, iteration and backend, in the profile's project and entity (issue 33,
names; decisions #60). The names are read back from the offline run's own file, as `wandb sync` would upload it."""

from __future__ import annotations

import json
import sys

from tests.helpers import ROOT, run, wandb_offline_runs

PY = sys.executable


def test_an_exports_coherence_run_is_named_by_run_and_iteration_in_the_profiles_project(smollm2_dir, tmp_path,
                                                                                         pipeline_env):
    it_dir = tmp_path / "my_sft" / "checkpoints" / "iter_0000020"
    hf = it_dir / "hf"
    hf.mkdir(parents=True)
    for f in smollm2_dir.iterdir():  # the export's weights and tokenizer (the real model's files)
        if f.is_file():
            (hf / f.name).symlink_to(f)
    (hf / "pipeline_export.json").write_text(json.dumps({"hf_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                         "source": str(it_dir), "iteration": 20}))
    profile = tmp_path / "team.yaml"
    profile.write_text("name: team\ncoherence_wandb_project: team-gen-tests\nwandb_entity: team-ent\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n")
    env = {**pipeline_env, "PIPELINE_CLUSTER": str(profile), "WANDB_ENTITY": ""}
    env.pop("COHERENCE_WANDB_PROJECT", None)
    argv = [PY, "pipeline_coherence_test.py", str(hf), "--prompts", str(prompts), "--max-tokens", "4", "--quiet"]
    plan = run([*argv, "--dry-run"], env=env, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "W&B: project team-gen-tests, entity team-ent, run coherence-my_sft-iter_0000020-hf" in plan.stdout
    res = run(argv, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    runs = wandb_offline_runs(tmp_path / "wandb")
    assert [(r["name"], r["project"], r["entity"]) for r in runs] == [
        ("coherence-my_sft-iter_0000020-hf", "team-gen-tests", "team-ent")], runs
    # the command line wins over the profile (and COHERENCE_WANDB_PROJECT over the profile): the plan says so
    plan = run([*argv, "--dry-run", "--wandb-project", "mine", "--wandb-entity", "me", "--compare", str(smollm2_dir)],
               env={**env, "COHERENCE_WANDB_PROJECT": "exported"}, cwd=ROOT)
    assert "W&B: project mine, entity me, run coherence-my_sft+1-iter_0000020-hf" in plan.stdout, plan.stdout
    plan = run([*argv, "--dry-run"], env={**env, "COHERENCE_WANDB_PROJECT": "exported"}, cwd=ROOT)
    assert "W&B: project exported, entity team-ent," in plan.stdout, plan.stdout
