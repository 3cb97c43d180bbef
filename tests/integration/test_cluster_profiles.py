"""Cluster profiles carry the cluster: with isambard_gh200 selected (--cluster, or PIPELINE_CLUSTER) and nothing
else exported, the shell knobs, the dry run and the rendered sbatch line show the profile's runtime, image,
bad-node log, partition and GPUs per node; an exported variable wins; bad profile values are one-line errors;
the sbatch options are rendered by a pure function in which the user's options win."""

import os
import sys

import pytest
import yaml

from pipeline.common.errors import UserError
from pipeline.config.cluster import ClusterProfile, load_cluster, resolve_profile
from pipeline.config.flat_yaml import parse_profile_text
from pipeline.slurm.sbatch_options import profile_sbatch_options, script_directives
from tests.helpers import ROOT, run

GH = "/projects/a5k/public"
SIF = f"{GH}/containers/nemo-26.06.sif"
BAD_LOG = f"{GH}/isambard_sbatch_bad_nodes.log"
NANO = "configs/quickstart/nemotron_nano_quickstart_sft.yaml"
SUPER = "configs/quickstart/nemotron_super_quickstart_sft.yaml"


def clean_env(**extra) -> dict:
    """An environment with nothing of the pipeline exported (env -i plus PATH and HOME)."""
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), **extra}


def shell(script: str, **extra) -> str:
    res = run(["bash", "-c", f"export PIPELINE_ROOT={ROOT}; {script}"], env=clean_env(**extra))
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "cluster").glob("*.yaml")), ids=lambda p: p.stem)
def test_the_hand_parser_reads_every_profile_as_yaml_does(path):
    text = path.read_text()
    assert parse_profile_text(text, str(path)) == yaml.safe_load(text)
    load_cluster(path.stem)  # and every shipped profile validates


def test_shell_knobs_come_from_the_selected_profile_and_exports_win():
    echo = "echo $PIPELINE_RUNTIME $PIPELINE_SIF $PIPELINE_BAD_NODES_LOG $PIPELINE_LOG_DIR $PIPELINE_CACHE_DIR $HF_HOME"
    out = shell(f"PIPELINE_CLUSTER=isambard_gh200; source pipeline_env_config.env; {echo}")
    assert out.split() == ["apptainer", SIF, BAD_LOG, f"{GH}/logs", f"{GH}/cache", f"{GH}/cache/huggingface"]
    # nothing selected: the laptop's values, under the checkout
    out = shell(f"source pipeline_env_config.env; {echo}")
    assert out.split()[:5] == ["venv", f"{ROOT}/.cache/containers/nemo-26.06.sif", f"{ROOT}/.slurm/bad_nodes.log",
                               f"{ROOT}/logs", f"{ROOT}/.cache"]
    # an exported variable wins, also when the file is sourced again (a job under isambard_sbatch)
    out = shell(f"PIPELINE_CLUSTER=isambard_gh200; source pipeline_env_config.env; source pipeline_env_config.env; "
                f"{echo}", PIPELINE_RUNTIME="charliecloud", PIPELINE_SIF="/my/img 'x'.sif")
    assert out.startswith(f"charliecloud /my/img 'x'.sif {BAD_LOG} ")
    # values a profile filled are refilled when another profile is selected in a child process
    out = shell("source pipeline_env_config.env; PIPELINE_CLUSTER=isambard_gh200 bash -c "
                "'source pipeline_env_config.env; echo $PIPELINE_RUNTIME $PIPELINE_SIF'")
    assert out == f"apptainer {SIF}"


def test_one_resolver_picks_the_profile_in_one_order(tmp_path):
    """--cluster, else PIPELINE_CLUSTER, else the config's pipeline.cluster, else the default (none: one line)."""
    env = {"PIPELINE_CLUSTER": "isambard_gh200"}
    assert resolve_profile("local_cpu", "isambard_gh200", env).name == "local_cpu"
    assert resolve_profile(None, "local_cpu", env).name == "isambard_gh200"
    assert resolve_profile(None, "isambard_gh200", {}).name == "isambard_gh200"
    assert resolve_profile(None, None, {}).name == "local_cpu"
    with pytest.raises(UserError, match="no cluster profile: the config names none"):
        resolve_profile(None, None, {}, default=None)


def test_a_second_sourcing_for_the_same_profile_starts_no_python(tmp_path):
    """A job step or a launcher under a launcher sources the env config again: with the profile already resolved
    the helper is not started (here no python3 is on PATH for the second sourcing); another profile starts it."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("sha256sum", "cut", "cat"):
        (tools / tool).symlink_to(f"/usr/bin/{tool}")
    echo = "echo $PIPELINE_RUNTIME $PIPELINE_SIF"
    out = shell(f"PIPELINE_CLUSTER=isambard_gh200; source pipeline_env_config.env; PATH={tools}; "
                f"source pipeline_env_config.env; {echo}")
    assert out == f"apptainer {SIF}"
    res = run(["bash", "-c", f"export PIPELINE_ROOT={ROOT}; source pipeline_env_config.env; PATH={tools}; "
               "PIPELINE_CLUSTER=isambard_gh200; source pipeline_env_config.env"], env=clean_env())
    assert res.returncode != 0 and "python3" in res.stderr


def test_a_profile_selected_by_path_is_refilled_by_another(tmp_path):
    prof = tmp_path / "site.yaml"
    prof.write_text("name: site\nruntime: charliecloud\n")
    out = shell(f"PIPELINE_CLUSTER={prof}; source pipeline_env_config.env; PIPELINE_CLUSTER=isambard_gh200 bash -c "
                "'source pipeline_env_config.env; echo $PIPELINE_RUNTIME $PIPELINE_SIF'")
    assert out == f"apptainer {SIF}"


def test_hub_and_wandb_defaults_come_from_the_profile(tmp_path):
    """The cluster reaches the hub (the laptop does not); W&B is online when a key exists, and `wandb login`'s
    netrc counts as one; an exported value wins."""
    echo = "echo $HF_HUB_OFFLINE $WANDB_MODE"
    home = tmp_path / "home"
    home.mkdir()
    assert shell(f"PIPELINE_CLUSTER=isambard_gh200; source pipeline_env_config.env; {echo}", HOME=str(home)) == \
        "0 offline"
    assert shell(f"source pipeline_env_config.env; {echo}", HOME=str(home)) == "1 offline"
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (home / ".netrc").chmod(0o600)
    assert shell(f"PIPELINE_CLUSTER=isambard_gh200; source pipeline_env_config.env; {echo}", HOME=str(home)) == \
        "0 online"
    assert shell(f"source pipeline_env_config.env; {echo}", HOME=str(tmp_path / "nohome"), WANDB_API_KEY="k") == \
        "1 online"
    assert shell(f"PIPELINE_CLUSTER=isambard_gh200; source pipeline_env_config.env; {echo}", HOME=str(home),
                 HF_HUB_OFFLINE="1", WANDB_MODE="disabled") == "1 disabled"


def test_the_helper_runs_on_the_host_python_without_yaml(tmp_path):
    # -S: no site-packages, so PyYAML cannot be imported; the profile must still be read
    res = run([sys.executable, "-S", "-m", "pipeline.config.knobs", "env", "isambard_gh200"],
              env=clean_env(PYTHONPATH=str(ROOT / "src")))
    assert res.returncode == 0, res.stderr
    assert f"PIPELINE_SIF={SIF}" in res.stdout.splitlines()


BAD_VALUES = [
    ("runtime: docker", "runtime 'docker' is not one of venv, apptainer, charliecloud"),
    ("gpus_per_node: -1", "gpus_per_node -1 must be >= 0"),
    ("time_limit: 24h", "time_limit '24h' is not a Slurm time"),
    ("partition: \"a'; echo foo\"", "partition \"a'; echo foo\" is not a Slurm name"),
    ("exclusive: maybe", "exclusive 'maybe' must be true or false"),
    ("sif: [a, b]", "only plain scalars are supported"),
    ("gpus: 4", "unknown keys ['gpus']"),
    ("hub_offline: sometimes", "hub_offline 'sometimes' must be true or false"),
    ("wandb_mode: loud", "wandb_mode 'loud' is not one of auto, online, offline, disabled"),
    ("wandb_entity: \"my team\"", "wandb_entity 'my team' is not a W&B entity name"),
]


@pytest.mark.parametrize("line,message", BAD_VALUES, ids=[b[0].split(":")[0] for b in BAD_VALUES])
def test_bad_profile_values_are_one_line_errors(tmp_path, line, message):
    prof = tmp_path / "site.yaml"
    prof.write_text(f"name: site\n{line}\n")
    res = run([sys.executable, "-m", "pipeline.config.knobs", "env", str(prof)],
              env=clean_env(PYTHONPATH=str(ROOT / "src")))
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr
    # the shell side stops with the same line instead of running on half-set knobs
    res = run(["bash", "-c", f"set -e; PIPELINE_ROOT={ROOT}; PIPELINE_CLUSTER={prof}; source pipeline_env_config.env;"
               " echo reached"], env=clean_env())
    assert res.returncode == 2 and "reached" not in res.stdout and message in res.stderr


def test_profile_renders_sbatch_options_and_user_options_win():
    gh = load_cluster("isambard_gh200")
    assert profile_sbatch_options(gh, ["--nodes=16"]) == ["--exclusive", "--gpus-per-node=4", "--time=24:00:00"]
    site = ClusterProfile(name="site", gpus_per_node=4, partition="gpu", account="a5k", time_limit="1-00:00:00",
                          exclusive=True)
    assert profile_sbatch_options(site, []) == ["--account=a5k", "--exclusive", "--gpus-per-node=4",
                                                "--partition=gpu", "--time=1-00:00:00"]
    # the user's options win, in every spelling; the coherence job's --gpus-per-node=1 stays the only one
    user = ["--gpus-per-node=1", "-p", "debug", "-Aother", "--time", "5", "--oversubscribe"]
    assert profile_sbatch_options(site, user) == []
    assert profile_sbatch_options(site, ["--gres=gpu:2", "--exclusive=user"]) == [
        "--account=a5k", "--partition=gpu", "--time=1-00:00:00"]
    # the script's own #SBATCH header beats the profile (each pipeline keeps its time limit)
    directives = script_directives(str(ROOT / "pipeline_training_submit.sbatch"))
    assert "--time=24:00:00" in directives and not any(d.startswith("--gpus-per-node") for d in directives)
    assert "--time=1-00:00:00" not in profile_sbatch_options(site, [], directives)
    # the laptop adds nothing: the local Slurm's defaults
    assert profile_sbatch_options(load_cluster("local_cpu"), []) == []
    # hostile values never reach the renderer: the profile refuses them
    for bad in ({"partition": "gpu --wrap=rm"}, {"account": "a;b"}, {"time_limit": "1:00; id"}):
        with pytest.raises(UserError):
            ClusterProfile(name="x", **bad)


@pytest.mark.parametrize("select", ["--cluster", "PIPELINE_CLUSTER"])
def test_dry_run_and_sbatch_line_show_the_profile(select):
    argv = ["bash", "pipeline_training_launch.sh", NANO, "--model", "nano", "--mode", "sft", "--disable-ft",
            "--dry-run", "--nodes", "16", "--no-path-checks"]
    if select == "--cluster":
        argv += ["--cluster", "isambard_gh200"]
    else:
        # PIPELINE_CLUSTER selects the container runtime, which this machine does not have (the launcher refuses
        # to start without it): run the launcher's Python as it runs inside the container, after the env config.
        argv = ["bash", "-c", f"export PIPELINE_ROOT={ROOT} PIPELINE_CLUSTER=isambard_gh200 PYTHONPATH={ROOT}/src; "
                "source pipeline_env_config.env; exec \"$0\" -m pipeline.cli.train \"$@\"", sys.executable,
                *argv[2:]]
    res = run(argv, env=clean_env(), timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    plan = out.split("== cluster profile ==")[1].split("==")[0]
    for needle in ("runtime: apptainer", f"image: {SIF}", f"bad-node log: {BAD_LOG}",
                   "partition (cluster default)", "gpus per node 4", "exclusive yes"):
        assert needle in plan, (needle, plan)
    line, note = out.split("== sbatch line ==")[1].strip().splitlines()[:2]
    assert "isambard_sbatch --nodes=16 pipeline_training_submit.sbatch" in line
    assert note.startswith("# isambard_sbatch adds from cluster profile isambard_gh200: --exclusive --gpus-per-node=4;")
    if select == "--cluster":  # the line selects the profile for the job, so the job gets the same knobs
        assert line.startswith("PIPELINE_CLUSTER=isambard_gh200 isambard_sbatch ")
    for needle in ("runtime apptainer", f"image {SIF}", f"bad-node log {BAD_LOG}", "gpus per node 4"):
        assert needle in note, (needle, note)


def test_a_site_profile_with_partition_and_account_reaches_the_sbatch_line(tmp_path):
    text = (ROOT / "configs/cluster/isambard_gh200.yaml").read_text()
    prof = tmp_path / "site.yaml"
    prof.write_text(text.replace("name: isambard_gh200", "name: site").replace("partition: null", "partition: gh200")
                    .replace("account: null", "account: a5k"))
    res = run(["bash", "pipeline_training_launch.sh", SUPER, "--model", "super", "--mode", "sft", "--disable-ft",
               "--dry-run", "--nodes", "16", "--no-path-checks", "--cluster", str(prof)],
              env=clean_env(PIPELINE_BAD_NODES_LOG=str(tmp_path / "our bad.log")), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "slurm: partition gh200, account a5k, gpus per node 4" in res.stdout
    assert f"bad-node log: {tmp_path}/our bad.log (exported)" in res.stdout  # the exported variable wins
    assert f"bad-node log '{tmp_path}/our bad.log'" in res.stdout
    note = res.stdout.split("== sbatch line ==")[1].strip().splitlines()[1]
    assert "adds from cluster profile site: --account=a5k --exclusive --gpus-per-node=4 --partition=gh200;" in note
    assert "partition gh200, gpus per node 4" in note


def test_the_super_quickstart_passes_the_preflight_on_isambard():
    res = run(["bash", "pipeline_training_launch.sh", SUPER, "--model", "super", "--mode", "sft", "--disable-ft",
               "--dry-run", "--nodes", "16", "--no-path-checks"], env=clean_env(), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "== preflight: PASS ==" in res.stdout
    assert "cluster isambard_gh200" in res.stdout and "tp 1 pp 8 cp 4 ep 4 etp 1 -> dp 2" in res.stdout
