"""Binds as a profile fact (issue 33, decision "binds as a profile fact"): the cluster profile lists what a container
job must see (data, checkpoint, model, log and cache roots; /opt/cray for the aws-ofi-nccl plugin's libfabric),
every launcher's container command binds it and puts the libfabric folder on LD_LIBRARY_PATH, and a plan refuses a
path the container would not see in one line naming the bind to add. The venv runtime (local_cpu) is unaffected."""

import os
from pathlib import Path

import pytest

from pipeline.cli.train import plan_from_argv
from pipeline.config.cluster import load_cluster
from pipeline.env.runtimes import RuntimeConfig, invisible_paths, job_runtime, render
from tests.helpers import ROOT, image_record, run

GH = "/projects/a5k/public"
FABRIC = "/opt/cray/libfabric/1.22.0/lib64"
PROFILE_YAML = ROOT / "configs" / "cluster" / "isambard_gh200.yaml"
NANO = "configs/quickstart/nemotron_nano_quickstart_sft.yaml"
NANO_TOK = "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
NANO_HF = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
KNOBS = ("PIPELINE_RUNTIME", "PIPELINE_SIF", "PIPELINE_LOG_DIR", "PIPELINE_CACHE_DIR", "PIPELINE_BINDS",
         "PIPELINE_PROFILE_BINDS", "PIPELINE_FABRIC_LIBS", "PIPELINE_PROFILE_FILLED", "PIPELINE_CLUSTER",
         "PIPELINE_DATA_ROOT", "PIPELINE_RUNS_DIR", "PIPELINE_MODELS_DIR", "HF_HOME", "WANDB_DIR")


@pytest.fixture(autouse=True)
def no_exported_knobs(monkeypatch):
    """Nothing of a runtime exported: the profile alone decides what the container sees."""
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)


def site_profile(tmp_path, extra_bind: str) -> str:
    """The Isambard profile with one more bind (a site that binds its own data folder)."""
    path = tmp_path / "isambard_site.yaml"
    path.write_text(PROFILE_YAML.read_text().replace("  - /opt/cray\n", f"  - /opt/cray\n  - {extra_bind}\n"))
    return str(path)


def test_the_isambard_profile_binds_its_roots_and_libfabric():
    profile = load_cluster("isambard_gh200")
    assert set(profile.binds) >= {f"{GH}/data", f"{GH}/checkpoints", f"{GH}/logs", f"{GH}/cache", "/opt/cray"}
    assert profile.ld_library_path == FABRIC
    # every /projects path a shipped config reads lies under one of them
    for cfg in sorted((ROOT / "configs").rglob("*.yaml")):
        for word in cfg.read_text().split():
            if word.startswith("/projects/") and "containers/" not in word and "bad_nodes" not in word:
                assert any(word == b or word.startswith(b + "/") for b in profile.binds), (cfg, word)
    assert load_cluster("local_cpu").binds == () and load_cluster("local_cpu").runtime == "venv"


def test_the_rendered_apptainer_command_binds_the_profile_and_libfabric(tmp_path):
    cfg = job_runtime(load_cluster("isambard_gh200"), {"PIPELINE_ROOT": str(ROOT), "HOME": "/home/alice"})
    assert cfg.runtime == "apptainer"
    argv = render(cfg, "true", {"PIPELINE_FABRIC_LIBS": FABRIC})
    bind = argv[argv.index("--bind") + 1].split(",")
    for path in (f"{GH}/data", f"{GH}/checkpoints", f"{GH}/logs", f"{GH}/cache", "/opt/cray", str(ROOT)):
        assert f"{path}:{path}" in bind, bind
    assert len(bind) == len(set(bind))  # a folder bound once
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    ld = next(e for e in envs if e.startswith("LD_LIBRARY_PATH="))
    assert ld.startswith(f"LD_LIBRARY_PATH={cfg.nccl_plugin_dir}/lib:{FABRIC}:"), ld
    # a HOST:CONTAINER pair binds as given
    pair = RuntimeConfig.from_env({"PIPELINE_ROOT": str(ROOT), "PIPELINE_RUNTIME": "apptainer",
                                   "PIPELINE_PROFILE_BINDS": "/lus/data:/data"})
    paired = render(pair, "true", {})
    assert "/lus/data:/data" in paired[paired.index("--bind") + 1].split(",")


@pytest.mark.parametrize("runtime", ["apptainer", "charliecloud"])
def test_every_launcher_renders_the_binds_through_the_env_config(runtime):
    """Every launcher sources pipeline_env_config.env and renders its container command with
    `python3 -m pipeline.env.runtimes render` (lib.sh): with only PIPELINE_CLUSTER exported, the profile's binds
    and libfabric folder reach that command."""
    script = (f"export PIPELINE_ROOT={ROOT} PIPELINE_CLUSTER=isambard_gh200 PIPELINE_RUNTIME={runtime}; "
              "source pipeline_env_config.env && PYTHONPATH=$PIPELINE_ROOT/src python3 -m pipeline.env.runtimes "
              "render -- true | tr '\\0' '\\n'")
    res = run(["bash", "-c", script], env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")})
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for path in (f"{GH}/data", f"{GH}/checkpoints", "/opt/cray"):
        assert f"{path}:{path}" in out, out
    if runtime == "apptainer":
        assert f"/lib:{FABRIC}:/usr/local/cuda/lib64" in out


def test_training_refuses_a_dataset_outside_the_binds(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    plan = plan_from_argv([NANO, "--model", "nano", "--mode", "sft", "--disable-ft", "--dry-run", "--nodes", "16",
                           f"dataset.dataset_root={data}"])
    line = (f"dataset.dataset_root {data} is not visible in the container (apptainer): bind it for your jobs with "
            f"export PIPELINE_BINDS={data} (comma-separated SRC[:DST]), or for every user add it (or a folder above "
            "it) to the cluster profile's binds (configs/cluster/isambard_gh200.yaml)")
    assert line in plan.preflight.problems, plan.preflight.problems


def test_the_bind_refusal_names_pipeline_binds_first_and_it_works(tmp_path, monkeypatch):
    """Issue 49 item 5: a path outside the binds is refused with the one-user fix first (PIPELINE_BINDS, keeping
    what it already holds), and that fix makes the same plan see it; the shared profile is the second choice."""
    data = tmp_path / "data"
    data.mkdir()
    argv = [NANO, "--model", "nano", "--mode", "sft", "--disable-ft", "--dry-run", "--nodes", "16",
            f"dataset.dataset_root={data}", "--no-path-checks"]
    monkeypatch.setenv("PIPELINE_BINDS", "/scratch/mine")
    plan = plan_from_argv([a for a in argv if a != "--no-path-checks"])
    line = next(p for p in plan.preflight.problems if p.startswith(f"dataset.dataset_root {data} is not visible"))
    assert f"export PIPELINE_BINDS=/scratch/mine,{data} " in line
    assert line.index("PIPELINE_BINDS") < line.index("cluster profile's binds")
    monkeypatch.setenv("PIPELINE_BINDS", f"/scratch/mine,{data}")
    plan = plan_from_argv([a for a in argv if a != "--no-path-checks"])
    assert not any("is not visible" in p and "dataset_root" in p for p in plan.preflight.problems)


def test_training_passes_with_the_dataset_inside_the_binds(tmp_path, monkeypatch):
    from tests.unit.test_preflight_packed import write_packs

    data, ckpt = tmp_path / "data", tmp_path / "models" / "nano"
    write_packs(data)  # a readable packed Parquet: the preflight reads it (decisions #56)
    (ckpt / "iter_0000000").mkdir(parents=True)  # an imported base: a tracker and its iteration
    (ckpt / "iter_0000000" / "common.pt").write_bytes(b"x")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("0")
    argv = [NANO, "--model", "nano", "--mode", "sft", "--disable-ft", "--dry-run", "--nodes", "16", f"dataset.dataset_root={data}",
            f"checkpoint.pretrained_checkpoint={ckpt}"]
    monkeypatch.setenv("PIPELINE_SIF", str(tmp_path / "nemo.sif"))
    image_record(tmp_path / "nemo.sif")  # validate's record of the image: it holds the recipe's GPU packages
    assert any("checkpoint.pretrained_checkpoint" in p and "not visible" in p
               for p in plan_from_argv(argv).preflight.problems)
    plan = plan_from_argv(argv + ["--cluster", site_profile(tmp_path, str(tmp_path))])
    assert plan.preflight.problems == [], plan.preflight.problems
    # the venv runtime sees the host's files: local_cpu never asks for a bind
    assert invisible_paths(load_cluster("local_cpu"), [("dataset.dataset_root", "/nowhere/data")], {}) == []


def test_an_export_plan_refuses_a_checkpoint_outside_the_binds(tmp_path):
    from pipeline.checkpoint.plan import ExportJob, plan_export

    ckpt = tmp_path / "run" / "checkpoints"
    plan = plan_export(ExportJob(ckpt, NANO_HF, cluster="isambard_gh200", nodes=1))
    line = (f"checkpoint directory {ckpt} is not visible in the container (apptainer): bind it for your jobs with "
            f"export PIPELINE_BINDS={ckpt.parent} (comma-separated SRC[:DST]), or for every user add it (or a folder "
            "above it) to the cluster profile's binds (configs/cluster/isambard_gh200.yaml)")
    assert line in plan.problems, plan.problems
    inside = plan_export(ExportJob(ckpt, NANO_HF, cluster=site_profile(tmp_path, str(tmp_path)), nodes=1))
    assert not any("not visible" in p for p in inside.problems), inside.problems
    shipped = plan_export(ExportJob(Path(f"{GH}/checkpoints/runs/x"), NANO_HF,
                                    cluster="isambard_gh200", nodes=1))
    assert not any("not visible" in p for p in shipped.problems), shipped.problems
    local = plan_export(ExportJob(ckpt, "tiny-qwen3-moe", cluster="local_cpu", nodes=1))
    assert not any("not visible" in p for p in local.problems)


def test_a_link_under_a_bind_that_leads_outside_every_bind_is_not_visible(tmp_path):
    """Issue 60, item 8: binds were checked on the path as written: checkpoint.save=<bound>/link/ck with link
    pointing outside every bind passed (the container would see a dangling link), while the same folder named
    directly was refused. The real path is checked too; a link inside the bind, and a bind whose source is itself a
    link, stay visible."""
    bound, outside = tmp_path / "bound", tmp_path / "outside"
    (bound / "inner").mkdir(parents=True)
    outside.mkdir()
    (bound / "out").symlink_to(outside)
    (bound / "in").symlink_to(bound / "inner")
    (tmp_path / "alias").symlink_to(bound)  # a site whose bound folder is a link to the real one
    profile = load_cluster(site_profile(tmp_path, str(bound)))
    env = {"PIPELINE_ROOT": str(ROOT)}
    lines = invisible_paths(profile, [("checkpoint.save", str(bound / "out" / "ck")),
                                      ("checkpoint.load", str(outside / "ck")),
                                      ("dataset.dataset_root", str(bound / "in" / "data"))], env)
    assert [ln.split(" ", 2)[:2] for ln in lines] == [["checkpoint.save", str(bound / "out" / "ck")],
                                                     ["checkpoint.load", str(outside / "ck")]], lines
    aliased = load_cluster(site_profile(tmp_path, str(tmp_path / "alias")))
    assert invisible_paths(aliased, [("checkpoint.save", str(tmp_path / "alias" / "in" / "ck"))], env) == []


def test_a_bind_at_another_name_does_not_make_a_link_into_its_source_visible(tmp_path):
    """Hostile pass of issue 60, W8: with a bind SRC:DST (SRC != DST), a path in another bind that links into
    SRC was judged visible (its real path lies under SRC), but the container mounts SRC at DST only: the link's
    target does not exist there. A path under DST names SRC's files on the host and is visible; a link in it that
    leads to another of SRC's folders by an absolute target is not."""
    src, other = tmp_path / "lustre" / "proj", tmp_path / "home"
    (src / "data").mkdir(parents=True)
    other.mkdir()
    (other / "ln").symlink_to(src / "data")
    (src / "abs").symlink_to(src / "data")
    profile = load_cluster(site_profile(tmp_path, f"{src}:/mnt/proj\n  - {other}"))  # and home at its own name
    env = {"PIPELINE_ROOT": str(ROOT)}
    lines = invisible_paths(profile, [("dataset.dataset_root", str(other / "ln")),
                                      ("checkpoint.load", "/mnt/proj/data/ck"),
                                      ("checkpoint.save", "/mnt/proj/abs/ck")], env)
    assert [ln.split(" ", 2)[:2] for ln in lines] == [["dataset.dataset_root", str(other / "ln")],
                                                     ["checkpoint.save", "/mnt/proj/abs/ck"]], lines
