"""The shared bad-node log: concurrent writers, TTL, CRUD, hostile input never reaches sbatch."""

import datetime as dt

import pytest

from pipeline.cli import sbatch as sbatch_cli
from pipeline.common.errors import UserError
from pipeline.slurm import sbatch_options
from pipeline.slurm.badnodes import BadNodeLog, Entry
from tests.helpers import ROOT


def test_ttl_prune_update_unmark(tmp_path):
    log = BadNodeLog(tmp_path / "bad.log", ttl_days=7)
    log.mark("nid[001-002]", "GPU ECC")
    old = Entry(dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(days=8), "nid999", "bob",
                "login2", "old news")
    with open(log.path, "a") as f:
        f.write(old.line() + "\n")
    assert [e.node for e in log.active()] == ["nid001", "nid002"]  # the 8-day-old entry is not excluded
    assert log.prune() == 1
    assert "nid999" not in log.path.read_text()
    log.update("nid001", "Xid 79")
    assert {e.node: e.reason for e in log.entries()}["nid001"] == "Xid 79"
    assert log.unmark("nid002") == 1
    with pytest.raises(UserError, match="no entry"):
        log.unmark("nid002")


def test_malformed_lines_are_skipped_and_never_reach_sbatch(tmp_path, monkeypatch, capsys):
    log = tmp_path / "bad.log"
    BadNodeLog(log).mark("nid000007", "ok")
    with open(log, "a") as f:
        f.write("garbage without tabs\n")
        f.write("2026-11-30T00:00:00Z\tnid1;rm -rf /\tu\th\tr\n")
        f.write("not-a-date\tnid000008\tu\th\tr\n")
    monkeypatch.setenv("BAD_NODES_LOG", str(log))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    cmd, bad, _ = sbatch_cli.build_submission(["--nodes=2", "-x", "nid[010-011]", "job.sbatch", "arg"])
    assert bad == ["nid000007"]
    assert cmd == ["sbatch", "--nodes=2", "--exclude=nid000007,nid[010-011]", "job.sbatch", "arg"]
    assert capsys.readouterr().err.count("skipping malformed line") == 3
    with pytest.raises(UserError, match="invalid --exclude"):
        sbatch_cli.build_submission(["--exclude=a;b", "job.sbatch"])


def test_training_submission_runs_preflight(monkeypatch, tmp_path):
    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    with pytest.raises(UserError, match=r"ep\(8\) \* etp\(1\) = 8 > gpus_per_node\(4\)"):
        sbatch_cli.build_submission(["--nodes=16", "pipeline_training_submit.sbatch",
                                     "configs/quickstart/nemotron_nano_quickstart_sft.yaml", "nano", "sft",
                                     "--no-path-checks", "model.expert_model_parallel_size=8"])


def test_launcher_and_sbatch_node_counts_must_agree(monkeypatch, tmp_path):
    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    argv = ["pipeline_training_submit.sbatch", "configs/quickstart/nemotron_nano_quickstart_sft.yaml", "nano", "sft",
            "--disable-ft", "--no-path-checks"]
    with pytest.raises(UserError, match=r"the launcher's --nodes 32 and sbatch's --nodes=16 disagree"):
        sbatch_cli.build_submission(["--nodes=16", *argv, "--nodes", "32"])
    cmd, _, _ = sbatch_cli.build_submission(["--nodes=16", *argv, "--nodes", "16"])  # the same count twice is fine
    assert "--nodes=16" in cmd


def test_a_planned_training_submission_takes_its_plan_s_cluster(monkeypatch, tmp_path):
    """The cluster profile's Slurm options come from the training plan (the launcher's own resolution of the
    config), not from reading the YAML with a pattern: a flow-style YAML the pattern cannot read still gets its
    profile's options."""
    import yaml

    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.delenv("PIPELINE_CLUSTER", raising=False)
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    cfg = yaml.safe_load((ROOT / "configs/quickstart/nemotron_nano_quickstart_sft.yaml").read_text())
    assert cfg["pipeline"]["cluster"] == "isambard_gh200"
    flow = tmp_path / "flow.yaml"
    flow.write_text(yaml.safe_dump(cfg, default_flow_style=True))
    args = [str(flow), "nano", "sft", "--disable-ft", "--no-path-checks"]
    from pipeline.cli.submission import submission_profile

    assert submission_profile("pipeline_training_submit.sbatch", args).name == "local_cpu"  # the pattern misses it
    cmd, _, _ = sbatch_cli.build_submission(["--nodes=16", "pipeline_training_submit.sbatch", *args])
    assert "--gpus-per-node=4" in cmd and "--exclusive" in cmd, cmd  # isambard_gh200's options, from the plan


# ---- host lists, and what isambard_sbatch checks before it queues a job -----------------------------------
import random  # noqa: E402

from pipeline.slurm.hostlist import compress, expand  # noqa: E402


def test_hostlist_compress_round_trips_and_fits_argument_limits():
    rng = random.Random(0)
    names = [f"nid{i:06d}" for i in rng.sample(range(1_000_000), 5000)]
    names += ["gpu-a_1.x", "a1b2", "nid1", "nid01", "nid001", "x", "node9", "node10", "n0", "n00"]
    expr = compress(names)
    assert sorted(expand(expr)) == sorted(set(names))
    assert compress(["nid001", "nid002", "nid003", "nid004", "nid010"]) == "nid[001-004,010]"
    every = [f"nid{i:06d}" for i in range(100_000)]
    assert compress(every) == "nid[000000-099999]" and expand(compress(every)) == every


def test_exclusion_of_100000_logged_nodes_is_a_short_argument(tmp_path, monkeypatch):
    log = tmp_path / "bad.log"
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    log.write_text("".join(f"{now}\tnid{i:06d}\tu\th\tr\n" for i in range(100_000)))
    monkeypatch.setenv("BAD_NODES_LOG", str(log))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    cmd, bad, _ = sbatch_cli.build_submission(["job.sbatch"])
    assert len(bad) == 100_000
    (ex,) = [a for a in cmd if a.startswith("--exclude=")]
    assert ex == "--exclude=nid[000000-099999]"
    sparse = [f"nid{i:07d}" for i in range(0, 2_000_000, 3)][:100_000]
    value = sbatch_cli.render_exclude(sparse, spill_dir=tmp_path)
    assert len(value) < 131072
    if "/" in value:  # too long even compressed: handed to sbatch as a file of node names
        assert sorted(expand(open(value).read().strip())) == sparse
    else:
        assert sorted(expand(value)) == sparse


@pytest.mark.parametrize("argv,needle", [
    (["pipeline_checkpoint_submit.sbatch", "export", "/nonexistent", "--hf-model", "a/b", "--no-reasoning"],
     "checkpoint directory /nonexistent does not exist"),
    # the job's arguments go through its own pipeline's parser (pipeline_checkpoint_convert.sh's, ...): its words
    (["pipeline_checkpoint_submit.sbatch", "export", "/tmp", "--hf-model", "a/b"],
     "one of the arguments --reasoning --no-reasoning is required"),
    (["pipeline_checkpoint_submit.sbatch", "exprot", "/tmp"],
     "invalid choice: 'exprot' (choose from 'export', 'import', 'upload-all')"),
    (["pipeline_data_submit.sbatch", "prepare", "--dataset", "/nope.jsonl", "--seq-length", "256"],
     "dataset /nope.jsonl does not exist"),
    (["pipeline_data_submit.sbatch", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "2e9"],
     "argument --seq-length: invalid int value: '2e9'"),
    (["pipeline_data_submit.sbatch", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "2000000"],
     "--seq-length must be between 2 and 1048576, got 2000000"),
    (["pipeline_data_submit.sbatch", "/nope", "tok", "256"], "dataset root /nope does not exist"),
    (["pipeline_coherence_submit.sbatch", "/nope/hf"], "model /nope/hf does not exist"),
    (["pipeline_coherence_submit.sbatch", "m", "--backend", "endpoint", "--discovery-file", "/nope.endpoint"],
     "discovery file /nope.endpoint does not exist"),
    (["pipeline_env_submit.sbatch", "install"], "must be setup or validate"),
])
def test_each_pipeline_is_checked_before_anything_is_queued(monkeypatch, tmp_path, argv, needle):
    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        sbatch_cli.build_submission(argv)


def test_export_submission_checks_the_iteration(monkeypatch, tmp_path):
    from pipeline.common import layout

    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    ck = tmp_path / "ck"
    ck.mkdir()
    with pytest.raises(UserError, match="iteration 200 does not exist"):
        sbatch_cli.build_submission(["pipeline_checkpoint_submit.sbatch", "export", str(ck), "--hf-model", "a/b",
                                     "--no-reasoning", "--iteration", "200"])
    with pytest.raises(UserError, match="no complete checkpoint"):
        sbatch_cli.build_submission(["pipeline_checkpoint_submit.sbatch", "export", str(ck), "--hf-model", "a/b",
                                     "--no-reasoning"])
    assert layout.read_tracker(ck) is None


def test_a_dependent_submission_leaves_its_input_paths_to_the_job(monkeypatch, tmp_path):
    """With --dependency the inputs are the outputs of the job it waits for: their existence is checked in the job;
    the shape of the arguments is still checked before anything is queued."""
    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    later = tmp_path / "not-yet" / "checkpoints"
    export = ["pipeline_checkpoint_submit.sbatch", "export", str(later), "--hf-model", "a/b", "--no-reasoning",
              "--iteration", "40"]
    with pytest.raises(UserError, match="does not exist"):
        sbatch_cli.build_submission(export)
    cmd, _, _ = sbatch_cli.build_submission(["--dependency=afterok:12", *export])
    assert cmd[-len(export):] == export and "--dependency=afterok:12" in cmd
    cmd, _, _ = sbatch_cli.build_submission(["-d", "afterok:12", "pipeline_coherence_submit.sbatch",
                                             str(later / "iter_0000040" / "hf")])
    assert cmd[-1].endswith("iter_0000040/hf")
    with pytest.raises(UserError, match="argument --iteration: invalid int value: 'x'"):
        sbatch_cli.build_submission(["--dependency=afterok:12", *export[:-1], "x"])
    with pytest.raises(UserError, match="the following arguments are required: --hf-model"):
        sbatch_cli.build_submission(["--dependency=afterok:12", "pipeline_checkpoint_submit.sbatch", "export",
                                     str(later)])


def test_getopt_like_parsing():
    table = (frozenset({"-N", "--nodes", "-J", "--job-name", "--comment", "-x", "--exclude", "-o", "--output"}),
             frozenset({"-H", "--hold", "--parsable"}))
    opts, ex, script, rest = sbatch_options.split_sbatch_args(
        ["--hold", "-HN", "2", "--comment", "-N5", "--job", "x", "-xn1", "--", "s.sbatch", "-N", "9"], table)
    assert opts == ["--hold", "-H", "-N", "2", "--comment=-N5", "--job-name=x"] and ex == ["n1"]
    assert script == "s.sbatch" and rest == ["-N", "9"]
    assert sbatch_options.option_value(opts, "--nodes", "-N") == "2"  # not the comment's "-N5"
    with pytest.raises(UserError, match="unknown sbatch option '-Z'"):
        sbatch_options.split_sbatch_args(["-HZ", "s.sbatch"], table)
    with pytest.raises(UserError, match="ambiguous"):
        sbatch_options.split_sbatch_args(["--no", "s.sbatch"], (frozenset({"--nodes", "--nodelist"}), frozenset()))


@pytest.mark.parametrize("node", ["n" * 62 + "[10-11]"])
def test_expanded_names_are_checked_before_writing(tmp_path, node):
    log = BadNodeLog(tmp_path / "bad.log")
    with pytest.raises(UserError, match="at most 63 characters"):
        log.mark(node, "x")
    assert not (tmp_path / "bad.log").exists() or (tmp_path / "bad.log").read_text() == ""


def test_the_scripts_own_exclude_is_kept_when_the_log_has_entries(tmp_path, monkeypatch):
    """sbatch lets a command-line --exclude replace the header's #SBATCH --exclude: the header's nodes must be merged
    in (issue 22, item 4: ExcNodeList=node2 instead of node2,node3)."""
    log = tmp_path / "bad.log"
    BadNodeLog(log).mark("node2", "GPU Xid 79")
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --exclude=node3,node[5-6]\n#SBATCH -x node9\nhostname\n")
    monkeypatch.setenv("BAD_NODES_LOG", str(log))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    cmd, bad, _ = sbatch_cli.build_submission([str(script)])
    assert bad == ["node2"]
    (ex,) = [a for a in cmd if a.startswith("--exclude=")]
    assert sorted(sbatch_cli.expand(ex.split("=", 1)[1])) == ["node2", "node3", "node5", "node6", "node9"]
    script.write_text("#!/bin/bash\n#SBATCH --exclude=a;b\nhostname\n")
    with pytest.raises(UserError, match="invalid --exclude value 'a;b'"):
        sbatch_cli.build_submission([str(script)])


@pytest.mark.parametrize("command, rest", [("--list-bad", []), ("--mark-bad", ["nid000001", "x"]),
                                           ("--unmark-bad", ["nid000001"]), ("--prune-bad", [])])
def test_a_directory_as_the_bad_node_log_is_one_line_and_makes_no_lock_beside_it(tmp_path, monkeypatch, command,
                                                                                    rest):
    """BAD_NODES_LOG=/ was a traceback (no name to put .lock beside); BAD_NODES_LOG=/tmp made /tmp.lock (issue 34)."""
    from pipeline.cli.badnodes import run_command
    from pipeline.slurm.badnodes import from_env

    monkeypatch.setenv("BAD_NODES_LOG", "/")
    with pytest.raises(UserError, match=r"BAD_NODES_LOG='/' does not name a file"):
        run_command(from_env(), command, rest)
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setenv("BAD_NODES_LOG", str(logs))
    with pytest.raises(UserError, match=f"the bad-node log {logs} is a directory"):
        run_command(from_env(), command, rest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # no logs.lock
