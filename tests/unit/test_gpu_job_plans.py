"""The GPU jobs other than training, planned before they are queued (issue 21): export, upload-all, import and
coherence (hf and megatron backends) for Nano and Super on the Isambard profile, the reference's commands, the
impossible layouts, and isambard_sbatch refusing what cannot run."""

from __future__ import annotations

import os

import pytest

from pipeline.checkpoint.plan import ExportJob, import_target, plan_export, plan_import
from pipeline.cli import sbatch as sbatch_cli
from pipeline.cli.checkpoint import plan_from_argv as checkpoint_plan
from pipeline.cli.coherence import plan_from_argv as coherence_plan
from pipeline.common.errors import UserError
from pipeline.config.cluster import load_cluster
from pipeline.config.models import get_model
from tests.helpers import ROOT

NANO, SUPER = get_model("nano").hf_id, get_model("super").hf_id


@pytest.fixture(autouse=True)
def _paths_are_bound(tmp_path, monkeypatch):
    """The plans here are about layouts, memory and hub rules; the paths they name are bound into the container (the
    binds rule has its own tests: tests/unit/test_container_binds.py)."""
    monkeypatch.setenv("PIPELINE_BINDS", ",".join((str(tmp_path), "/no-such-run", "/c", "/ckpts", "/runs")))
    # nor is the megatron checkpoint they name read (that rule's tests: tests/unit/test_audit_issue34.py)
    monkeypatch.setattr("pipeline.coherence.plan._checkpoint_problem", lambda cfg: None)


@pytest.fixture(autouse=True)
def isambard(monkeypatch):
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODEID"):
        monkeypatch.delenv(k, raising=False)


def test_a_single_process_super_export_is_refused_with_the_layout_that_fits():
    plan = plan_export(ExportJob(ROOT / "no-such-run", SUPER, tp=1, pp=1, ep=1, inputs_later=True, strict=False))
    assert plan.problems == ["estimated 247.0 GB per GPU > 95 GB on 'isambard_gh200' (export 247.0, verify_megatron "
                             "245.0, verify_hf 65.0): use --tp 1 --pp 1 --ep 4 (77.8 GB)"]


@pytest.mark.parametrize("argv, needle", [
    (["export", "/c", "--hf-model", NANO, "--no-reasoning", "--tp", "4", "--ep", "8"],
     "ep(8) * etp(1) = 8 > gpus_per_node(4) on 'isambard_gh200'"),
    (["export", "/c", "--hf-model", NANO, "--no-reasoning", "--tp", "8"],
     "tp(8) = 8 > gpus_per_node(4) on 'isambard_gh200'"),
    (["export", "/c", "--hf-model", NANO, "--no-reasoning", "--pp", "2", "--ep", "4"],
     "an export runs on one node: world 8"),
    (["upload-all", "/c", "--hf-model", SUPER, "--no-reasoning", "--not-strict", "--nodes", "2"],
     "an export runs on one node, and 2 were asked for"),
    (["import", "nano", "--nodes", "4"],
     "import runs on one node, and 4 were asked for: isambard_sbatch --nodes=1 pipeline_checkpoint_submit.sbatch "
     "import nano"),
    (["import", "super", "--nodes", "3", "--tp", "1", "--pp", "4", "--ep", "4"],
     "the import's layout (--tp 1 --pp 4 --ep 4, world 16) runs on 4 node(s), and 3 were asked for: submit it with "
     "--nodes=4"),
    (["import", "nano", "--tp", "8"], "tp(8) = 8 > gpus_per_node(4) on 'isambard_gh200'"),
])
def test_impossible_checkpoint_jobs_are_refused(argv, needle):
    plan = checkpoint_plan(argv)
    assert any(needle in p for p in plan.problems), plan.problems


def test_layout_problems_of_coherence():
    bad = coherence_plan(["/c", "--backend", "megatron", "--hf-model", NANO, "--tp", "4", "--ep", "8"], 2)
    assert any("ep(8) * etp(1) = 8 > gpus_per_node(4)" in p for p in bad.problems)
    endpoint = coherence_plan(["m", "--backend", "endpoint", "--endpoint-url", "http://x:1"], 1)
    assert endpoint.ok and endpoint.world == 1 and endpoint.memory_gb == {}
    with pytest.raises(UserError, match="--tp/--pp/--ep apply to the megatron backend only"):
        coherence_plan(["m", "--tp", "2"], 1)
    two = coherence_plan([SUPER], 2)
    assert "the hf backend runs on one node, and 2 were asked for" in two.problems[0]


@pytest.mark.parametrize("model, layout, gb", [(NANO, (1, 1, 1, 1), 68.4), (SUPER, (4, 1, 1, 4), 76.0)])
def test_megatron_generation_without_layout_flags_gets_the_smallest_that_fits(model, layout, gb):
    plan = coherence_plan(["/c", "--backend", "megatron", "--hf-model", model])
    assert (plan.world, plan.layout.tp, plan.layout.pp, plan.layout.ep) == layout
    assert plan.ok and plan.memory_per_gpu_gb == gb
    assert "layout: the smallest that fits" in plan.notes[0]


def test_hf_backend_spreads_super_over_the_node():
    nano, sup = coherence_plan([NANO]), coherence_plan([SUPER])
    assert nano.ok and "on one GPU" in nano.notes[0] and nano.memory_per_gpu_gb < 95
    assert sup.ok and "over the node's 4 GPUs (device_map='auto')" in sup.notes[0] and sup.memory_per_gpu_gb < 95


def test_import_fetches_what_the_shipped_config_reads_and_writes_where_it_looks(tmp_path):
    import yaml

    profile = load_cluster("isambard_gh200")
    for name, config in (("nano", "nemotron_nano_quickstart_sft.yaml"), ("super", "nemotron_super_quickstart_sft.yaml")):
        fetch, out, megatron = import_target(name, None, profile)
        cfg = yaml.safe_load((ROOT / "configs" / "quickstart" / config).read_text())
        assert megatron and str(out) == cfg["checkpoint"]["pretrained_checkpoint"]
        assert out.name == fetch.split("/")[-1]
    assert import_target("nano", None, profile)[0] == "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16"
    plan = plan_import("nano", tmp_path / "nano")  # its own output: on the cluster the default one exists
    assert plan.ok and plan.host_memory_gb == 68.2 and plan.world == 1


def test_a_local_engine_export_is_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    plan = plan_export(ExportJob(tmp_path / "none", get_model("tiny-qwen3-moe").hf_id, inputs_later=True))
    assert plan.ok and plan.engine == "local" and plan.world == 1 and plan.launch[0] == "python"


@pytest.mark.parametrize("argv, ok", [
    (["--nodes=1", "pipeline_checkpoint_submit.sbatch", "export", "CKPT", "--hf-model", SUPER, "--no-reasoning",
      "--not-strict"], True),
    (["--nodes=1", "pipeline_checkpoint_submit.sbatch", "export", "CKPT", "--hf-model", SUPER, "--no-reasoning"],
      False),  # no --not-strict: the MTP shards (and lm_head.weight) would be dropped
    (["--nodes=1", "pipeline_checkpoint_submit.sbatch", "export", "CKPT", "--hf-model", SUPER, "--no-reasoning",
      "--not-strict", "--ep", "1"], False),
    (["--nodes=4", "pipeline_checkpoint_submit.sbatch", "import", "super"], True),  # torchrun, tp 1 pp 4 ep 4
    (["--nodes=4", "--gpus-per-node=1", "pipeline_checkpoint_submit.sbatch", "import", "super"], False),
    (["--nodes=4", "pipeline_coherence_submit.sbatch", "CKPT", "--backend", "megatron", "--hf-model", SUPER,
      "--tp", "4", "--pp", "4", "--ep", "4"], True),
    (["--nodes=6", "pipeline_coherence_submit.sbatch", "CKPT", "--backend", "megatron", "--hf-model", SUPER,
      "--tp", "4", "--pp", "6", "--ep", "4"], False),  # the reference's: 88 layers do not split into 6 stages
    (["pipeline_coherence_submit.sbatch", "CKPT", "--backend", "megatron", "--hf-model", SUPER, "--tp", "4",
      "--pp", "4", "--ep", "4"], False),  # the script's own --nodes=1
    # --gpus-per-node on the line: an EP=4 export on one GPU, and Super on one GPU (it needs the node's four), are
    # refused before the queue; the README's one-GPU hf test of an export that fits one GPU passes
    (["--nodes=1", "--gpus-per-node=1", "pipeline_checkpoint_submit.sbatch", "export", "CKPT", "--hf-model", NANO,
      "--no-reasoning"], False),
    (["--gpus-per-node=1", "pipeline_coherence_submit.sbatch", SUPER], False),
    (["--gpus-per-node=1", "pipeline_coherence_submit.sbatch", NANO], True),
])
def test_isambard_sbatch_checks_each_plan(tmp_path, monkeypatch, capsys, argv, ok):
    ckpt = tmp_path / "ckpts"
    (ckpt / "iter_0000010").mkdir(parents=True)
    (ckpt / "iter_0000010" / "metadata.json").write_text("{}")
    (ckpt / "iter_0000010" / "common.pt").write_bytes(b"")
    (ckpt / "iter_0000010" / ".metadata").write_bytes(b"")  # torch_dist's completion file
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    argv = [str(ckpt) if a == "CKPT" else a for a in argv]
    if "import" in argv:  # its own output (issue 59, item 8: on the cluster the default one holds the import)
        argv += ["--output", str(tmp_path / "imported")]
    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    if ok:
        cmd, _, _ = sbatch_cli.build_submission(argv)
        assert cmd[0] == "sbatch" and "Plan: PASS" in capsys.readouterr().err
    else:
        with pytest.raises(UserError, match="nothing was submitted"):
            sbatch_cli.build_submission(argv)


def test_a_plan_with_more_ranks_than_the_nodes_gpus_is_refused(monkeypatch):
    """Inside `srun --gpus-per-node=1`, a 4-rank export would start local ranks without a GPU; the hf backend's one
    process is fine there (the README's `--gpus-per-node=1` coherence command)."""
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "nid001")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "1")
    plan = plan_export(ExportJob(ROOT / "no-such-run", NANO, inputs_later=True))
    assert plan.problems == ["the plan places 4 ranks on each node, and the allocation has 1 GPU(s) per node: "
                             "submit with --gpus-per-node=4"]
    assert coherence_plan([NANO]).ok


@pytest.mark.parametrize("argv, line", [
    (["export", "CKPT", "--hf-model", NANO, "--no-reasoning", "--iteration", "999"],
     "iteration 999 does not exist in CKPT"),
    (["export", "CKPT", "--hf-model", NANO, "--no-reasoning", "--tp", "0"], "--tp 0 must be >= 1"),
    (["export", "CKPT", "--hf-model", NANO, "--no-reasoning", "--pp", "1000000000"],
     "world size 1000000000 is more than 65536 ranks"),
])
def test_hostile_export_plans_are_one_line(tmp_path, argv, line):
    """Found by a hostile review: a huge layout built every rank group (a hang), --tp 0 planned as 1, an absent
    iteration was a note."""
    ckpt = tmp_path / "ckpts"
    (ckpt / "iter_0000010").mkdir(parents=True)
    for f in ("metadata.json", "common.pt", ".metadata"):
        (ckpt / "iter_0000010" / f).write_text("{}")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    argv = [str(ckpt) if a == "CKPT" else a for a in argv]
    try:
        plan = checkpoint_plan(argv)
    except UserError as exc:
        problems = [str(exc)]
    else:
        problems = plan.problems
    assert any(p.startswith(line.replace("CKPT", str(ckpt))) for p in problems), problems


@pytest.mark.parametrize("argv, line", [
    (["x", "--backend", "megatron", "--hf-model", NANO, "--ep", "1000000000"],
     "world size 1000000000 is more than 65536 ranks"),
    (["smollm2-135m"], "'smollm2-135m' is a registry name, not a model"),
    (["/no/such/dir"], "model /no/such/dir does not exist"),
    (["m", "--backend", "endpoint", "--endpoint-url", "http://x:1"], "the endpoint backend runs on one node"),
    ([SUPER, "--max-tokens", "0"], "--max-tokens must be in [1, 1048576], got 0"),
    (["m", "--backend", "endpoint"], "the endpoint backend needs --endpoint-url URL or --discovery-file FILE"),
])
def test_hostile_coherence_plans_are_one_line(argv, line):
    try:
        problems = coherence_plan(argv, 3 if "endpoint" in argv and "--endpoint-url" in argv else None).problems
    except UserError as exc:
        problems = [str(exc)]
    assert any(p.startswith(line) for p in problems), problems


def test_a_malformed_slurm_environment_is_one_line(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "abc")
    with pytest.raises(UserError, match="the Slurm environment is malformed"):
        coherence_plan([SUPER])


# ---- the cluster profile's env reaches every GPU job (issue 32, item 8) -------------------------------------
PROBE_ENV = {"PIPELINE_PROBE_VAR": "marker", "NCCL_NET": "AWS Libfabric"}


def probe_profile(where, gpus: int = 4):
    """A cluster profile whose env holds a probe variable (and a value with a space, as NCCL_NET's)."""
    path = where / f"probe_{gpus}gpu.yaml"
    path.write_text(f"name: probe\ngpus_per_node: {gpus}\ngpu_memory_gb: {95 if gpus else 0}\nhost_memory_gb: 480\n"
                    "env:\n  PIPELINE_PROBE_VAR: marker\n  NCCL_NET: \"AWS Libfabric\"\n")
    return path


@pytest.mark.parametrize("job", ["export", "upload-all", "import", "coherence-hf", "coherence-megatron-4-nodes",
                                 "export-local"])
def test_every_gpu_jobs_plan_sets_the_cluster_profiles_env(tmp_path, monkeypatch, job):
    """The plan (and so its dry run: the launch line and --json's env) carries the profile's env for every GPU job,
    not only training; before, only the training launcher read it."""
    monkeypatch.setenv("PIPELINE_CLUSTER", str(probe_profile(tmp_path, 0 if job == "export-local" else 4)))
    plan = {
        "export": lambda: checkpoint_plan(["export", str(tmp_path), "--hf-model", NANO, "--no-reasoning"],
                                          inputs_later=True),
        "upload-all": lambda: checkpoint_plan(["upload-all", str(tmp_path), "--hf-model", NANO, "--no-reasoning"]),
        "import": lambda: checkpoint_plan(["import", "nano"]),
        "coherence-hf": lambda: coherence_plan([NANO]),
        "coherence-megatron-4-nodes": lambda: coherence_plan(["/c", "--backend", "megatron", "--hf-model", SUPER,
                                                              "--tp", "4", "--pp", "4", "--ep", "4"], 4),
        "export-local": lambda: plan_export(ExportJob(tmp_path / "none", get_model("tiny-qwen3-moe").hf_id,
                                                      inputs_later=True)),
    }[job]()
    assert plan.ok, plan.problems
    assert plan.env == PROBE_ENV and plan.as_dict()["env"] == PROBE_ENV
    launch = next(ln for ln in plan.format().splitlines() if ln.startswith("  launch (each node): "))
    assert launch.startswith(f"  launch (each node): PIPELINE_PROBE_VAR=marker NCCL_NET='AWS Libfabric' "
                             f"{plan.launch[0]} "), launch
    if job in ("export", "coherence-megatron-4-nodes"):
        assert plan.launch[0] == "torchrun"


def test_upload_alls_per_iteration_torchrun_gets_the_profiles_env(tmp_path, monkeypatch):
    """upload-all of a Megatron checkpoint starts one torchrun per iteration (it needs GPUs and Megatron, so the
    command and the environment it is started with are checked here): the profile's env over the inherited one."""
    from pipeline.cli.checkpoint import export_torchrun, parse

    monkeypatch.setenv("PIPELINE_CLUSTER", str(probe_profile(tmp_path)))
    monkeypatch.setenv("PIPELINE_PROBE_VAR", "inherited")  # the profile's value wins, as training's always has
    argv = ["upload-all", str(tmp_path), "--hf-model", NANO, "--no-reasoning"]
    plan = checkpoint_plan(argv)
    cmd, env = export_torchrun(tmp_path / "iter_0000010", parse(argv), plan)
    assert cmd[:4] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=4"]
    assert cmd[cmd.index("--iteration") + 1] == "10" and "--lock-held" in cmd
    assert env["PIPELINE_PROBE_VAR"] == "marker" and env["NCCL_NET"] == "AWS Libfabric"
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is inherited


def test_the_checkpoint_request_reads_every_option_of_every_action(tmp_path):
    """cli/checkpoint.py reads its namespace once, into ConvertRequest: each option of export, import and
    upload-all is a field (none dropped, none probed with getattr later), and the export it asks for carries the
    plan's layout and the tolerances given."""
    import dataclasses

    from pipeline.cli.checkpoint import ConvertRequest, build_parser, parse
    from pipeline.config.parallel import Layout

    fields = {f.name for f in dataclasses.fields(ConvertRequest)}
    sub = next(a for a in build_parser()._actions if a.dest == "action")
    for name, parser in sub.choices.items():
        dests = {a.dest for a in parser._actions if a.dest != "help"}
        assert dests <= fields, (name, dests - fields)
    req = parse(["upload-all", str(tmp_path), "--hf-model", NANO, "--no-reasoning", "--atol", "0.5",
                 "--eval", "pipeline_smoke", "--eval-tasks-path", str(tmp_path)])
    assert (req.action, req.eval, req.eval_tasks_path, req.hub_repo, req.iteration) == \
        ("upload-all", "pipeline_smoke", (tmp_path,), None, None)
    export = req.export(Layout(4, ep=4))
    assert (export.atol, export.locked, export.layout.ep, export.strict) == (0.5, True, 4, True)
    assert export.argv()[:8] == ["--hf-model", NANO, "--no-reasoning", "--tp", "1", "--pp", "1", "--ep"]
    assert parse(["import", "nano", "--tp", "2"]).export(Layout(1)).hf_model == ""


def test_one_rule_for_the_ranks_environment():
    """cluster.job_env / job_environ: the inherited environment < the profile's env < training's env_vars."""
    from pipeline.config.job_env import job_env, job_environ

    profile_env = {"A": "profile", "B": "profile"}
    assert job_env(profile_env, {"B": 7}) == {"A": "profile", "B": "7"}
    assert job_environ(profile_env, {"A": "inherited", "C": "inherited"}, {"B": "config"}) == \
        {"A": "profile", "B": "config", "C": "inherited"}
    assert job_environ({}, {"C": "inherited"}) == {"C": "inherited"}


# ---- issue 33 --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("action", ["export", "upload-all"])
def test_a_super_export_without_not_strict_is_refused_with_the_fix(action):
    """Super has MTP layers and SFT/LoRA trains none: a strict export drops the MTP shards and lm_head.weight."""
    argv = [action, "/no-such-run", "--hf-model", SUPER, "--no-reasoning"]
    plan = checkpoint_plan(argv, inputs_later=True)
    assert [p for p in plan.problems if "--not-strict" in p] == [
        f"{SUPER} has MTP layers, which SFT and LoRA do not train: a strict export drops the shards holding the "
        "MTP keys, lm_head.weight with them (fatal for generation): add --not-strict"]
    assert checkpoint_plan([*argv, "--not-strict"], inputs_later=True).ok
    assert checkpoint_plan([action, "/no-such-run", "--hf-model", NANO, "--no-reasoning"], inputs_later=True).ok
    assert get_model("super").mtp_layers > 0 and get_model("nano").mtp_layers == 0


def test_a_super_import_is_never_single_process_and_host_memory_is_checked(tmp_path):
    """Super imports under torchrun on every GPU of the nodes it gets (the reference's --nodes=4: tp 1 pp 4 ep 4),
    its GPU memory per rank and host memory per node checked; Nano stays one process (decisions #83)."""
    gh = load_cluster("isambard_gh200")
    out = tmp_path / "out"  # its own output (issue 59, item 8): on the cluster the default one holds the import
    four = plan_import("super", out, nodes=4)  # the reference's command
    assert four.ok, four.problems
    assert (four.nodes, four.ranks_per_node, four.layout.tp, four.layout.pp, four.layout.ep) == (4, 4, 1, 4, 4)
    assert four.launch[:5] == ["torchrun", "--nnodes=4", "--nproc-per-node=4", "--rdzv-backend=c10d",
                               "--rdzv-endpoint=127.0.0.1:29500"]
    assert four.launch[-6:] == ["--tp", "1", "--pp", "4", "--ep", "4"]
    assert four.memory_gb == {"import": 22.7} and four.host_memory_gb == 90.8  # 4 ranks x (17.7 + 5) per node
    one = plan_import("super", out)  # one node: ep 4 over its GPUs, still torchrun
    assert one.ok and one.world == 4 and one.launch[0] == "torchrun" and one.host_memory_gb == 303.2
    assert one.host_memory_gb < gh.host_memory_gb and one.memory_per_gpu_gb < gh.memory_budget_gb
    assert not any(p.launch[0] == "python" for p in (one, four))  # never a single process
    nano = plan_import("nano", out)
    assert nano.ok and nano.world == 1 and nano.host_memory_gb == 68.2 and nano.host_memory_gb < gh.host_memory_gb


def test_a_parallel_import_that_does_not_fit_is_refused_with_the_fix(monkeypatch, tmp_path):
    small = tmp_path / "small.yaml"
    small.write_text((ROOT / "configs" / "cluster" / "isambard_gh200.yaml").read_text()
                     .replace("host_memory_gb: 440", "host_memory_gb: 200"))
    plan = plan_import("super", tmp_path / "out", cluster=str(small))
    assert plan.problems == ["import needs ~303 GB of host memory per node > 200 GB on 'isambard_gh200'"]
    assert plan_import("super", tmp_path / "out", nodes=4, cluster=str(small)).ok
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    assert plan_import("super").problems[-1].startswith("a model-parallel import runs one rank per GPU; cluster "
                                                        "profile 'local_cpu' has none")


def test_an_import_that_does_not_fit_the_hosts_memory_is_refused(monkeypatch):
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")
    plan = plan_import(NANO, nodes=1)
    assert any("import needs ~68 GB of host memory > 24 GB on 'local_cpu'" in p for p in plan.problems), plan.problems


def test_hub_repos_carry_the_run_and_the_iteration_and_offline_push_is_refused_at_planning(monkeypatch):
    """The online check (HfApi().whoami(), the namespace's role) needs the network and is not exercised here."""
    from pipeline.checkpoint.plan import hub_repo_name

    assert hub_repo_name(ROOT / "runs" / "sft_a" / "checkpoints", "iter_0000200") == "sft_a-iter_0000200"
    assert hub_repo_name(ROOT / "runs" / "sft_b" / "checkpoints", "iter_0000200") == "sft_b-iter_0000200"
    assert hub_repo_name(ROOT / "my_ckpts", "iter_0000010") == "my_ckpts-iter_0000010"
    argv = ["upload-all", "/no-such-run", "--hf-model", NANO, "--no-reasoning", "--push-to-hub"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plan = checkpoint_plan(argv, inputs_later=True)
    assert plan.problems == ["--push-to-hub needs the Hugging Face hub, and HF_HUB_OFFLINE=1: drop --push-to-hub or "
                             "run where the hub is reachable"]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    plan = checkpoint_plan(argv, inputs_later=True)
    assert plan.ok and any("<token's user>/no-such-run-iter_NNNNNNN" in n for n in plan.notes), plan.notes
    monkeypatch.setenv("PIPELINE_CLUSTER", "local_cpu")  # hub_offline: true
    plan = checkpoint_plan(["export", "/no-such-run", "--hf-model", NANO, "--no-reasoning", "--push-to-hub"],
                           inputs_later=True)
    assert "cluster profile 'local_cpu' is offline (hub_offline)" in plan.problems[-1]


def _pending_export(tmp_path, record: dict | None, config: dict):
    import json

    hf = tmp_path / "iter_0000200" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(config))
    if record is not None:
        (hf / "pipeline_export.json").write_text(json.dumps(record))
    return hf


def test_a_pending_export_is_sized_from_the_model_it_is_exported_from(tmp_path):
    """An hf/ whose weights are not written yet (the coherence job waits for the conversion) is not 0.0 GB."""
    hf = _pending_export(tmp_path, {"hf_model": SUPER}, {"vocab_size": 131072})
    plan = coherence_plan([str(hf)], inputs_later=True)
    assert plan.memory_per_gpu_gb > 60 and plan.gpus_per_node == 4, plan.format()
    assert "weights not written yet" in plan.notes[0]
    with pytest.raises(UserError, match="nothing was submitted"):  # Super on one GPU: refused before the queue
        sbatch_cli.build_submission(["--gpus-per-node=1", "pipeline_coherence_submit.sbatch", str(hf)])


def test_a_pending_export_without_a_record_is_sized_from_its_config(tmp_path):
    from pipeline.coherence.plan import config_params_b

    cfg = {"hidden_size": 4096, "vocab_size": 128000, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "tie_word_embeddings": False}
    assert 7.9 < config_params_b(cfg) < 8.2  # a Llama-3-8B-shaped config: 8.0B
    plan = coherence_plan([str(_pending_export(tmp_path, None, cfg))], inputs_later=True)
    assert 20 < plan.memory_per_gpu_gb < 95 and "config.json's architecture" in plan.notes[0]


# ---- issue 47 --------------------------------------------------------------------------------------------------
def _lora_run(tmp_path, model: str):
    """A LoRA run's iteration (Bridge's run_config.yaml with a peft: section) on Bridge's import of ``model``."""
    from tests.unit.test_lora_iterations import LORA, _iteration

    base = _iteration(tmp_path / "base", 0, hf=model)
    return _iteration(tmp_path / "lora", 2, hf=model, pretrained=str(base.parent), peft=LORA)


def test_a_super_lora_export_is_refused_in_one_line_naming_what_fits(tmp_path):
    """A LoRA iteration exports in one process (Bridge's export_adapter_ckpt, then peft's merge in float32 on the
    host; export.py refuses a world above 1): the plan gave Super's ep 4 and passed, and the export then needed
    ~245 GB on one 95 GB GPU and ~965 GB of the node's 440 GB of host memory. It is refused in one line with the
    memory needed and available and the models one process fits."""
    lora = _lora_run(tmp_path, SUPER)
    for layout in ([], ["--tp", "1", "--pp", "1", "--ep", "1"]):
        plan = checkpoint_plan(["export", str(lora.parent), "--hf-model", SUPER, "--no-reasoning", "--not-strict",
                                *layout])
        assert plan.world == 1 and plan.launch[0] == "python", plan.format()
        assert plan.problems == [
            f"{lora} is a LoRA iteration, which exports in one process (Bridge's export_adapter_ckpt, then peft's "
            f"merge into {SUPER} in float32 on the host): it needs 245.0 GB on one GPU and ~965 GB of host memory, "
            "and 'isambard_gh200' has 95 GB per GPU and 440 GB per node; one process fits models up to 44B "
            "parameters (nano: 68.2 GB per GPU, ~258 GB of host memory), super has 120B (its full-weight iterations "
            "export with --tp 1 --pp 1 --ep 4)"], plan.problems
    two = checkpoint_plan(["export", str(lora.parent), "--hf-model", SUPER, "--no-reasoning", "--not-strict",
                           "--ep", "4"])
    assert two.problems[0] == (f"{lora} is a LoRA iteration, which exports in one process: --tp 1 --pp 1 --ep 4 "
                               "(world 4) cannot run it; drop --tp/--pp/--ep")


def test_a_nano_lora_export_plans_one_process_that_fits(tmp_path):
    lora = _lora_run(tmp_path, NANO)
    plan = checkpoint_plan(["export", str(lora.parent), "--hf-model", NANO, "--no-reasoning"])
    assert plan.ok, plan.problems
    assert (plan.world, plan.nodes, plan.launch[0]) == (1, 1, "python")  # not ep 4: export.py refuses world > 1
    assert plan.memory_gb == {"verify_megatron": 68.2, "verify_hf": 68.2} and plan.host_memory_gb == 257.8
    assert any("LoRA iteration" in n and "one process" in n for n in plan.notes), plan.notes
    whole = checkpoint_plan(["export", str(tmp_path / "base"), "--hf-model", NANO, "--no-reasoning"])
    assert whole.ok and whole.world == 4  # a whole checkpoint keeps the model's export layout (ep 4)


def test_a_plan_without_size_facts_says_memory_not_estimated_not_zero(capsys, monkeypatch, tmp_path):
    """Issue 49 item 9: a coherence job on an export not yet written (a chain's, --dependency) passed its plan with
    'memory estimate 0.0 GB per GPU'; it says the memory was not estimated, and why."""
    from pipeline.cli.submission import check_job

    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    monkeypatch.setenv("PIPELINE_BINDS", str(tmp_path))
    check_job("pipeline_coherence_submit.sbatch", [str(tmp_path / "ck" / "iter_0000020" / "hf")],
              ["--dependency=afterok:1"])
    err = capsys.readouterr().err
    assert "Plan: PASS - coherence" in err and "memory not estimated" in err and "0.0 GB" not in err, err
