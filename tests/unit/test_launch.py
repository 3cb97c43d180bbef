"""Launch command and environment (pure functions): single node, multi-node under Slurm, ft_launcher flags,
the Bridge override YAML, and the coherence side-by-side report."""

import socket
from pathlib import Path

import yaml

from pipeline.bridge import bridge_overrides_yaml
from pipeline.cli.train import split_args
from pipeline.coherence.run import markdown
from pipeline.config.cluster import load_cluster
from pipeline.config.loader import load_config
from pipeline.config.models import get_model
from pipeline.slurm.allocation import Allocation, rendezvous
from pipeline.training.launch import launch_command


def test_single_node_torchrun():
    cmd = launch_command(get_model("smollm2-135m"), load_cluster("local_cpu"),
                         Allocation(None, 1, 0, [], None, 0), 1, "/r", disable_ft=True, max_restarts=2)
    assert cmd == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=1", "--max-restarts=2",
                   "-m", "pipeline.training.run", "--run-dir", "/r"]


def test_multi_node_ft_launcher_from_the_allocation(monkeypatch):
    monkeypatch.setattr("pipeline.slurm.allocation.node_address", lambda n: {"nid001": "10.1.0.1"}.get(n, n))
    alloc = Allocation("12345", 16, 3, [f"nid{i:03d}" for i in range(1, 17)], 4, 0)
    gh = load_cluster("isambard_gh200")
    cmd = launch_command(get_model("nano"), gh, alloc, 16, "/r", disable_ft=False, max_restarts=3)
    assert cmd[0] == "ft_launcher"
    assert "--rdzv-endpoint=10.1.0.1:32041" in cmd  # first node's address, per-job port 29500 + 12345 % 3268
    assert "--nnodes=16" in cmd and "--node-rank=3" in cmd and "--nproc-per-node=4" in cmd
    assert "--ft-rank_section_timeouts=setup:600,step:180,checkpointing:420" in cmd
    assert "--ft-rank_out_of_section_timeout=300" in cmd
    assert launch_command(get_model("nano"), gh, alloc, 16, "/r", disable_ft=True, max_restarts=3)[0] == "torchrun"
    assert gh.env["NCCL_NET"] == "AWS Libfabric" and gh.env["FI_PROVIDER"] == "cxi"


def test_use_nsys_profiler_wraps_each_nodes_launcher_in_nsys():
    """Issue 49 item 6: profiling.use_nsys_profiler=true on the Bridge engine passed the preflight and the launch line
    was never wrapped: Bridge's cudaProfilerStart/Stop had no nsys to start. Now the node's launcher runs under nsys
    with the profiler-API capture range (Bridge's profile ranks and step window), one report per node."""
    from pipeline.cli.train import plan_from_argv

    base = ["configs/quickstart/nemotron_nano_quickstart_sft.yaml", "--model", "nano", "--mode", "sft", "--disable-ft",
            "--dry-run", "--no-path-checks", "--nodes", "16", "--cluster", "isambard_gh200"]
    plain = plan_from_argv(base).command()
    assert plain[0] == "torchrun" and "nsys" not in plain
    cmd = plan_from_argv(base + ["profiling.use_nsys_profiler=true"]).command()
    run_dir = Path(cmd[cmd.index("--run-dir") + 1])
    assert cmd[:cmd.index("torchrun")] == [
        "nsys", "profile", "-s", "none", "-t", "nvtx,cuda", "-o", str(run_dir / "nsys" / "node0"), "--force-overwrite",
        "true", "--capture-range=cudaProfilerApi", "--capture-range-end=stop"]
    assert cmd[cmd.index("torchrun"):] == plain


def test_flags_and_overrides_are_split():
    flags, ov = split_args(["c.yaml", "--model", "nano", "--mode", "sft", "--disable-ft", "train.train_iters=5",
                            "+model.x=1", "~rng", "--nodes", "2", "checkpoint.save=null"])
    assert flags == ["c.yaml", "--model", "nano", "--mode", "sft", "--disable-ft", "--nodes", "2"]
    assert ov == ["train.train_iters=5", "+model.x=1", "~rng", "checkpoint.save=null"]


def test_bridge_override_yaml_keeps_only_bridge_keys():
    cfg = load_config("configs/quickstart/nemotron_nano_quickstart_sft.yaml", ["+model.moe_router_dtype=fp32"],
                      get_model("nano").recipe_defaults("sft"))
    out = yaml.safe_load(bridge_overrides_yaml(cfg))
    assert "pipeline" not in out and "dataset_name" not in out["dataset"]
    assert out["model"]["context_parallel_size"] == 2 and out["model"]["moe_router_dtype"] == "fp32"
    assert out["dataset"]["offline_packing_specs"]["pad_seq_to_mult"] == 16
    assert "ft" not in out  # unset sections are left to the recipe


def test_side_by_side_report():
    rows = lambda t: [{"prompt": "p1", "response": t, "response_length": len(t), "empty": not t, "truncated": False,
                       "repetitive": False, "template_leak": ""}]
    rep = {"time": "t", "prompts": ["p1"], "results": [
        {"model": "a", "backend": "hf", "rows": rows("one | two"), "summary": {"empty_pct": 0.0}},
        {"model": "b", "backend": "hf", "rows": rows(""), "summary": {"empty_pct": 100.0}}]}
    md = markdown(rep)
    assert "## Side by side" in md and "| p1 | one \\| two | *(empty)* |" in md


def test_the_training_dry_run_shows_the_environment_the_launch_sets(tmp_path, capsys):
    """The ranks get the cluster profile's env with the config's env_vars over it (cluster.job_env, the rule of
    every GPU job); the dry run shows it as NAME=value before the launch command."""
    from pipeline.cli.train import main, plan_from_argv
    from tests.unit.test_gpu_job_plans import probe_profile

    argv = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--dry-run",
            "--no-path-checks", "--cluster", str(probe_profile(tmp_path, gpus=0)), "+env_vars.NCCL_NET=Socket"]
    assert plan_from_argv(argv).env == {"PIPELINE_PROBE_VAR": "marker", "NCCL_NET": "Socket"}
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    launch = out[out.index("== launch command (per node) ==") + 1]
    assert launch.startswith("PIPELINE_PROBE_VAR=marker NCCL_NET=Socket torchrun --standalone "), launch


def test_rendezvous_ports_stay_below_the_kernels_ephemeral_range():
    """The port a job's nodes agree on is never one the kernel hands out for port 0 (a test's free-port server,
    torchrun --standalone, any client's outgoing connection): read against this machine's range, and against
    sockets really bound to port 0."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {rendezvous(Allocation(str(job), 2, 0, [], None, 0), 29500)[1] for job in range(0, 200000, 7)}
    assert min(ports) == 29500 and max(ports) == 32767 and max(ports) < low
    held = []
    try:
        for _ in range(64):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            held.append(sock)
        assert not {s.getsockname()[1] for s in held} & ports
    finally:
        for sock in held:
            sock.close()
    # a base the operator put at or above the ephemeral range keeps its 20,000 ports, within 65535
    assert rendezvous(Allocation("19999", 2, 0, [], None, 0), 40000)[1] == 59999
    assert rendezvous(Allocation("19999", 2, 0, [], None, 0), 60000)[1] == 60000 + 19999 % 5536


def test_the_launcher_is_an_object_of_the_profile():
    """Issue 65, item 4: the profile names its launcher (``launcher:``) and gives the object (config/launchers.py);
    --disable-ft is plain torchrun; the object writes the node's line the launch always had."""
    from pipeline.config.launchers import FT_LAUNCHER, TORCHRUN

    gh, local = load_cluster("isambard_gh200"), load_cluster("local_cpu")
    assert (gh.launcher_for(), gh.launcher_for(disable_ft=True), local.launcher_for()) == (FT_LAUNCHER, TORCHRUN,
                                                                                          TORCHRUN)
    assert (FT_LAUNCHER.fault_tolerance, TORCHRUN.fault_tolerance, str(FT_LAUNCHER)) == (True, False, "ft_launcher")
    assert TORCHRUN.argv(nproc=2, max_restarts=0, rendezvous=None) == [
        "torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0"]
    assert FT_LAUNCHER.argv(nproc=4, max_restarts=3, rendezvous=("10.0.0.1", 29501, "7", 2, 1),
                            ft_section_timeouts="setup:1", ft_out_of_section_timeout=5, prefix=["nsys", "profile"]) == [
        "nsys", "profile", "ft_launcher", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29501", "--rdzv-id=7",
        "--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--max-restarts=3", "--ft-rank_section_timeouts=setup:1",
        "--ft-rank_out_of_section_timeout=5"]


def test_under_nsys_the_ranks_still_know_their_launcher_is_ft_launcher(tmp_path):
    """The launch exported PIPELINE_LAUNCHER as the launch line's first word, which is ``nsys`` under Nsight Systems:
    the ranks of an ft_launcher launch with profiling.use_nsys_profiler then never turned on NVRx fault tolerance
    (megatron_bridge.launch_overrides, fault_tolerance.connect). It is the launcher object's name."""
    from pipeline.cli.train import plan_from_argv
    from pipeline.training.engines.megatron_bridge import launch_overrides

    base = ["configs/quickstart/nemotron_nano_quickstart_sft.yaml", "--model", "nano", "--mode", "sft", "--dry-run",
            "--no-path-checks", "--nodes", "16", "--cluster", "isambard_gh200", "--run-dir", str(tmp_path / "run"),
            f"checkpoint.save={tmp_path}/save", "profiling.use_nsys_profiler=true"]
    plan = plan_from_argv(base)
    env = plan.launch_environ(base={"PATH": "/usr/bin"})
    assert plan.command()[0] == "nsys" and "ft_launcher" in plan.command() and plan.launcher.fault_tolerance
    assert env["PIPELINE_LAUNCHER"] == "ft_launcher" and env["PIPELINE_RUN_DIR"] == str(plan.run_dir)
    assert env["PATH"] == "/usr/bin" and env["NCCL_NET"] == "AWS Libfabric"  # the profile's env over the base
    assert launch_overrides({**env, "TORCHELASTIC_RUN_ID": "1"}) == ["ft.enable_ft_package=true",
                                                                     "ft.calc_ft_timeouts=true"]
    plain = plan_from_argv([*base, "--disable-ft"])
    assert plain.launch_environ(base={})["PIPELINE_LAUNCHER"] == "torchrun" == plain.command()[plain.command().index(
        "torchrun")]
