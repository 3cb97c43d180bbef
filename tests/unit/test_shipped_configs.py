"""Every shipped training config plans PASS as its own header documents it, on its own profile; the docs state the
number of checks validate runs; the training log has the reference's name (issue 33: the GPU smoke config, names;
decisions #60, #61)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pipeline.cli.train import parse_request
from pipeline.env import validate
from pipeline.training.launch import plan_launch
from tests.helpers import ROOT

# every training config (cluster profiles, experiment files and the evaluation harness's task definitions are not)
TRAINING_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml")
                          if p.relative_to(ROOT / "configs").parts[0] not in ("cluster", "experiments", "eval"))


def documented_plan(config: Path) -> list[str]:
    """The `bash pipeline_training_launch.sh ... --dry-run ...` command of the config's header comment."""
    header = " ".join(line.lstrip("#").strip() for line in config.read_text().splitlines()
                      if line.startswith("#")).replace("\\ ", " ")
    found = [m.group(1) for m in re.finditer(r"bash pipeline_training_launch\.sh ((?:(?!bash |\)).)*--dry-run[^)]*)", header)]
    assert found, f"{config.relative_to(ROOT)}: its header documents no dry-run command"
    return shlex.split(found[0])


def test_every_training_config_is_found():
    names = {p.relative_to(ROOT).as_posix() for p in TRAINING_CONFIGS}
    assert {"configs/smoke/nemotron_nano_smoke_sft.yaml", "configs/quickstart/nemotron_nano_quickstart_sft.yaml",
            "configs/quickstart/nemotron_super_quickstart_sft.yaml", "configs/local/tiny_moe_sft.yaml"} <= names


@pytest.mark.parametrize("config", TRAINING_CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_config_plans_pass_as_its_header_documents(config, tmp_path, monkeypatch):
    monkeypatch.delenv("PIPELINE_CLUSTER", raising=False)  # the config's own profile (pipeline.cluster)
    argv = documented_plan(config)
    assert (ROOT / argv[0]).resolve() == config.resolve()
    req, dry_run = parse_request([str(ROOT / argv[0]), *argv[1:], "--run-dir", str(tmp_path / "run")])
    assert dry_run
    plan = plan_launch(req)
    assert plan.preflight.ok, (config.name, plan.cluster.name, plan.preflight.problems)


def test_the_gpu_smoke_config_fits_and_validate_plans_it(monkeypatch):
    """The first GPU run (decisions #61: Nano, seq 4096) was refused by the preflight: packs of 32768 against seq 4096,
    and 160 GB per GPU on one node. Its config now passes on its 4 nodes, and `validate --run-training` plans it."""
    monkeypatch.delenv("PIPELINE_CLUSTER", raising=False)
    assert "gpu-smoke-plan" in [c.name for c in validate.TRAINING_CHECKS]
    detail = validate.check_gpu_smoke_plan()
    assert detail.startswith(f"{validate.SMOKE_CONFIG} plans PASS on isambard_gh200 (4 nodes, ")
    assert "isambard_sbatch --nodes=4 pipeline_training_submit.sbatch" in detail
    gb = float(re.search(r"([\d.]+) GB per GPU", detail).group(1))
    assert gb <= 95


def test_the_docs_state_the_number_of_checks_validate_runs():
    base, full = len(validate.CHECKS), len(validate.CHECKS) + len(validate.TRAINING_CHECKS)
    # the README and the topic docs state today's count (decisions.md and benchmarks.md record past runs)
    docs = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
            if p.name not in ("decisions.md", "benchmarks.md")}
    stated = [(name, n, t) for name, text in docs.items()
              for n, t in re.findall(r"(\d+) (?:numbered validation )?checks(?: \((\d+) with --run-training\))?", text)]
    assert any(name == "README.md" for name, _, _ in stated), "README states no check count"
    for name, n, with_training in stated:
        assert int(n) == base, f"{name} says {n} checks; validate has {base}"
        assert not with_training or int(with_training) == full, f"{name} says {with_training}; validate has {full}"
    assert f"{base} numbered validation checks ({full} with --run-training)" in docs["docs/files.md"]


def test_the_training_log_has_the_references_name():
    from pipeline.cli.sbatch import log_path

    script = str(ROOT / "pipeline_training_submit.sbatch")
    assert log_path([], script, "123", None).name == "train-123.out"  # the reference: logs/slurm/train-<jobid>.out
    assert "tail -f logs/slurm/train-<jobid>.out" in (ROOT / "README.md").read_text()


def test_two_members_of_a_team_run_the_smoke_command_into_their_own_folders(monkeypatch):
    """Issue 49 item 3: the smoke config's save was one absolute folder, so only the first member of a team could run
    the documented command (the second: 'belongs to run /home/<first user>/...'). It carries the user now."""
    from pipeline.cli.train import plan_from_argv

    argv = ["configs/smoke/nemotron_nano_smoke_sft.yaml", "--model", "nano", "--mode", "sft", "--disable-ft",
            "--dry-run", "--nodes", "4", "--no-path-checks"]
    saves = {}
    for user in ("alice", "bob"):
        monkeypatch.setenv("USER", user)
        plan = plan_from_argv(argv)
        assert plan.preflight.ok, plan.preflight.problems
        saves[user] = str(plan.cfg.checkpoint.save)
    assert saves == {u: f"/projects/a5k/public/checkpoints/megatron/{u}/nemotron_nano_smoke_sft" for u in saves}


def test_list_names_every_model_mode_and_shipped_config(capsys):
    """Issue 49 item 7: the known models appeared only in an error message; --list names each model with its engine
    and recipe per mode, the modes, and every shipped training config with its header's first paragraph, whole
    (issue 59: its first line alone cut most descriptions mid-sentence: "... from random weights on a Megatron")."""
    from pipeline.cli.train import header_summary, main
    from pipeline.config.models import REGISTRY

    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in REGISTRY:
        assert any(line.startswith(f"  {name} ") for line in out.splitlines()), name
    assert "sft: megatron.bridge.recipes.nemotronh.nemotron_3_nano.nemotron_3_nano_sft_config" in out
    for config in TRAINING_CONFIGS:
        para = " ".join(config.read_text().split("\n#\n", 1)[0].replace("#", " ").split())
        summary = header_summary(config.read_text())
        assert summary.endswith((".", ")")) and summary.rstrip(".") == para.rstrip(":.").rstrip(":"), (config, summary)
        entry = " ".join(out.split(f"  {config.relative_to(ROOT)}", 1)[1].split("\n  configs/", 1)[0].split())
        assert entry == summary, (config, entry)


def test_a_bridge_pretraining_without_data_is_refused(tmp_path):
    """Issue 49 item 7: the recipes name no data, so a pretraining or CPT on Bridge without +dataset.data_path
    planned PASS and trained on Bridge's mock dataset (random tokens); with path checks a prefix needs its files."""
    from pipeline.cli.train import plan_from_argv

    for cfg, mode in (("nemotron_nano_pretrain", "pretrain"), ("nemotron_nano_cpt", "cpt")):
        argv = [f"configs/cluster_runs/{cfg}.yaml", "--model", "nano", "--mode", mode, "--dry-run", "--nodes", "16",
                "--no-path-checks"]
        plan = plan_from_argv(argv)
        assert any(p.startswith(f"mode {mode} on Megatron Bridge reads indexed data, and none is named")
                   for p in plan.preflight.problems), plan.preflight.problems
        assert plan_from_argv(argv + [f"+dataset.data_path=[{tmp_path}/text_text_document]"]).preflight.ok


def test_full_recompute_beside_per_module_cuda_graphs_is_refused(tmp_path):
    """Issue 58: Nano's pretraining recipe captures Transformer Engine CUDA graphs (cuda_graph_impl
    transformer_engine); megatron-core's TransformerConfig asserts "full recompute is only supported with full
    iteration CUDA graph" in Bridge's validate(), on every rank after the queue (the Bridge harness runs it:
    test_bridges_own_validation_passes_every_shipped_job). The shipped pretraining and CPT configs turn the graphs off
    (their full recompute is what fits 8K); putting the recipe's graphs back is one line on the login node."""
    from pipeline.cli.train import plan_from_argv

    data = f"+dataset.data_path=[{tmp_path}/text_text_document]"
    for cfg, mode in (("nemotron_nano_pretrain", "pretrain"), ("nemotron_nano_cpt", "cpt")):
        argv = [f"configs/cluster_runs/{cfg}.yaml", "--model", "nano", "--mode", mode, "--dry-run", "--nodes", "16",
                "--no-path-checks", data]
        assert plan_from_argv(argv).cfg.model.cuda_graph_impl == "none"
        plan = plan_from_argv([*argv, "model.cuda_graph_impl=transformer_engine"]).preflight
        assert plan.problems == ["model.recompute_granularity=full with model.cuda_graph_impl=transformer_engine (per-"
                                 "module CUDA graphs, the nano pretrain recipe's): megatron-core refuses full "
                                 "recompute beside them; set model.cuda_graph_impl=none, or "
                                 "recompute_granularity=selective"], plan.problems
        # the recipe's own graphs (the config's line removed) are what the preflight reads: the same refusal
        lines = Path(f"configs/cluster_runs/{cfg}.yaml").read_text().replace("  cuda_graph_impl: none\n", "")
        own = tmp_path / f"{cfg}.yaml"
        own.write_text(lines)
        plan = plan_from_argv([str(own), *argv[1:]]).preflight
        assert not plan.ok and "model.cuda_graph_impl=transformer_engine" in plan.problems[0], plan.problems
        # selective recompute beside the graphs is what megatron-core accepts
        ok = plan_from_argv([str(own), *argv[1:], "model.recompute_granularity=selective",
                             "model.recompute_method=null", "model.recompute_num_layers=null"]).preflight
        assert not any("cuda_graph_impl" in p for p in ok.problems), ok.problems

