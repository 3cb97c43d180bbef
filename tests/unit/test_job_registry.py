"""The job registry (issue 65, step 4): every shipped batch script is a kind of job in ``jobs/registry.py``, and
``isambard_sbatch`` (and the experiment layer) find a job there and plan it by call: the job's own parser reads its
words into a request, its planner returns a plan on the plan base (``jobs/plan.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pipeline.cli import sbatch as sbatch_cli
from pipeline.cli import submission
from pipeline.config.models import get_model
from pipeline.jobs import registry
from pipeline.jobs.plan import BasePlan
from tests.helpers import ROOT

NANO, SMOL = get_model("nano").hf_id, get_model("smollm2-135m").hf_id


def chat_file(where):
    path = where / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    return path


TINY_SFT = ["configs/local/tiny_moe_sft.yaml", "tiny-qwen3-moe", "sft"]
EXAMPLES = {  # each kind's words (the batch script's arguments) and the cluster profile it is submitted on
    "train": (lambda t: TINY_SFT, None),
    "export": (lambda t: ["export", str(t / "ckpt"), "--hf-model", NANO, "--no-reasoning"], "isambard_gh200"),
    "import": (lambda t: ["import", "nano", "--output", str(t / "nano")], "isambard_gh200"),
    "upload-all": (lambda t: ["upload-all", str(t / "ckpt"), "--hf-model", NANO, "--no-reasoning"], "isambard_gh200"),
    "coherence": (lambda t: [NANO], "isambard_gh200"),
    "evaluate": (lambda t: [SMOL, "--tasks", "pipeline_smoke"], "local_cpu"),
    "data": (lambda t: ["prepare", "--dataset", str(chat_file(t)), "--model", "smollm2-135m", "--seq-length", "512",
                        "--dataset-root", str(t / "data")], None),
    "env": (lambda t: ["validate"], None),
}


def test_every_shipped_batch_script_is_a_registered_job():
    assert sorted(registry.SCRIPTS) == sorted(p.name for p in ROOT.glob("*.sbatch"))
    assert sorted(registry.BY_KIND) == sorted(EXAMPLES)
    for job in registry.JOBS:
        assert (ROOT / job.script).is_file() and (ROOT / job.by_hand).is_file(), job
    assert submission.PIPELINE_SCRIPTS == registry.SCRIPTS
    assert registry.resolve("my_own_job.sbatch", ["export"]) is None  # isambard_sbatch submits any script
    # a script of several kinds by its first word; a word it does not know goes to its parser (which says so)
    assert [registry.resolve(str(ROOT / "pipeline_checkpoint_submit.sbatch"), [w]).kind
            for w in ("export", "import", "upload-all", "exprot")] == ["export", "import", "upload-all", "export"]


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_isambard_sbatch_resolves_each_script_through_the_registry(kind, tmp_path, monkeypatch, capsys):
    """A --dry-run submission of each shipped batch script: isambard_sbatch's check looks its job up in the registry
    (recorded here) and, for a planned kind, loads its planner from there and passes."""
    words, cluster = EXAMPLES[kind]
    if cluster:
        monkeypatch.setenv("PIPELINE_CLUSTER", cluster)
    else:
        monkeypatch.delenv("PIPELINE_CLUSTER", raising=False)
    monkeypatch.setenv("PIPELINE_BINDS", str(tmp_path))
    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    looked_up, loaded = [], []
    resolve, load = registry.resolve, registry.load
    monkeypatch.setattr(registry, "resolve", lambda *a: looked_up.append(resolve(*a)) or looked_up[-1])
    monkeypatch.setattr(registry, "load", lambda job: loaded.append(job.kind) or load(job))
    script = str(ROOT / registry.BY_KIND[kind].script)
    cmd, _, _ = sbatch_cli.build_submission(["--dry-run", "--dependency=afterok:1", script, *words(tmp_path)])
    assert cmd[0] == "sbatch" and script in cmd
    assert [j.kind for j in looked_up] == [kind]
    assert loaded == ([kind] if registry.BY_KIND[kind].planned else [])
    if registry.BY_KIND[kind].planned:
        assert "PASS - " in capsys.readouterr().err


@pytest.mark.parametrize("kind", [j.kind for j in registry.JOBS if j.planned])
def test_each_planned_kind_plans_by_call_on_the_base(kind, tmp_path, monkeypatch):
    """The registry walked: each planned kind's module parses its words into a request object and plans it, called
    with a Placement, into a plan of that kind on the plan base."""
    words, cluster = EXAMPLES[kind]
    if cluster:
        monkeypatch.setenv("PIPELINE_CLUSTER", cluster)
    monkeypatch.setenv("PIPELINE_BINDS", str(tmp_path))
    planner = registry.load(registry.BY_KIND[kind])
    request = planner.parse_job(words(tmp_path))
    assert not isinstance(request, (list, tuple, str))  # a request object, not the words again
    plan = planner.plan_job(request, registry.Placement(nodes=1, cluster=cluster, inputs_later=True))
    assert isinstance(plan, BasePlan) and plan.kind == kind, (type(plan), plan.kind)
    assert plan.profile is not None and plan.profile.name == plan.cluster
    assert plan.ok, plan.problems


def test_a_submission_of_a_kind_whose_planner_is_missing_says_how_to_make_one(tmp_path, monkeypatch):
    """The planner modules load only when a job is planned (a bare login node has no pipeline environment)."""
    def missing(job):
        raise ImportError("No module named 'orjson'")

    monkeypatch.setattr(registry, "load", missing)
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    with pytest.raises(submission.UserError, match=r"^the pipeline_coherence_submit.sbatch plan cannot be checked "
                                                   r"here: no pipeline venv or login-node planner \(No module named "
                                                   r"'orjson'\); create the planner with: .*nothing was submitted$"):
        submission.check_job("pipeline_coherence_submit.sbatch", [NANO], [])
    assert submission.check_job("pipeline_coherence_submit.sbatch", [NANO], [], required=False) == \
        submission.JobCheck()


@pytest.fixture
def gh200(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    monkeypatch.setenv("PIPELINE_BINDS", str(tmp_path))
    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    return tmp_path


SUPER = get_model("super").hf_id


@pytest.mark.parametrize("opts, words, line", [
    # --gpus is a total over the nodes Slurm allocates (sbatch's --nodes), not the job's own count (the review of the
    # registry: the plan's node count had been used, and these passed)
    (["--nodes=4", "--gpus=8"], ["import", "super"], "--gpus=8 is a total over the job's 4 nodes"),
    (["--nodes=2", "--gpus=4"], [NANO, "--tasks", "pipeline_smoke"], "--gpus=4 is a total over the job's 2 nodes"),
    # a job's own --nodes (a dry run's option) that is not the allocation's: it would plan and run on its own count
    (["--nodes=2", "--gpus=4"], ["import", "super", "--nodes", "1"],
     "the job's --nodes 1 and sbatch's --nodes=2 disagree"),
    (["--gpus=8"], ["import", "super", "--nodes", "2"], "the job's --nodes 2 and sbatch's --nodes=1 disagree"),
    (["--nodes=2"], [SUPER, "--backend", "megatron", "--hf-model", SUPER, "--nodes", "4"],
     "the job's --nodes 4 and sbatch's --nodes=2 disagree"),
    ([], [*TINY_SFT, "--nodes", "2"], "the launcher's --nodes 2 and sbatch's --nodes=1 (its default: neither the "
                                      "command line nor the script sets it) disagree"),
])
def test_a_submission_counts_nodes_as_slurm_allocates_them(gh200, opts, words, line):
    script = {"import": "pipeline_checkpoint_submit.sbatch", NANO: "pipeline_eval_submit.sbatch",
              SUPER: "pipeline_coherence_submit.sbatch"}.get(words[0], "pipeline_training_submit.sbatch")
    words = [*words, "--output", str(gh200 / "out")] if words[0] == "import" else words
    with pytest.raises(submission.UserError, match=re.escape(line)):
        sbatch_cli.build_submission(["--dry-run", *opts, str(ROOT / script), *words])


def test_agreeing_node_counts_pass(gh200, capsys):
    cmd, _, _ = sbatch_cli.build_submission(["--dry-run", "--nodes=4", str(ROOT / "pipeline_checkpoint_submit.sbatch"),
                                             "import", "super", "--nodes", "4", "--output", str(gh200 / "out")])
    assert "--nodes=4" in cmd and "Plan: PASS - import: world 16 on 4 node(s)" in capsys.readouterr().err


def test_the_old_profile_command_says_where_it_went():
    """``python3 -m pipeline.config.cluster env NAME`` printed the knobs; after the split it printed nothing with exit
    0 (a script reading its output got none). It now exits 2 naming the command."""
    res = subprocess.run([sys.executable, "-S", "-m", "pipeline.config.cluster", "env", "isambard_gh200"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == ("error: the cluster profile command is python3 -m pipeline.config.knobs env|show [NAME] "
                          "(or pipeline-cluster)\n")
