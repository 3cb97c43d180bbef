"""The shared bad-node log: concurrent writers, TTL, CRUD, hostile input never reaches sbatch."""

import concurrent.futures as cf
import datetime as dt

import pytest

from conftest import ROOT, run
from pipeline.common.errors import UserError
from pipeline.slurm import sbatch_cli
from pipeline.slurm.badnodes import BadNodeLog, Entry


def test_50_concurrent_marks_leave_50_valid_entries(tmp_path, pipeline_env):
    log = tmp_path / "bad.log"
    env = {**pipeline_env, "BAD_NODES_LOG": str(log)}

    def mark(i):
        return run([str(ROOT / "isambard_sbatch"), "--mark-bad", f"nid{i:06d}", f"reason {i}"], env=env)

    with cf.ThreadPoolExecutor(max_workers=50) as ex:
        results = list(ex.map(mark, range(50)))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results if r.returncode]
    entries = BadNodeLog(log).entries()
    assert sorted(e.node for e in entries) == [f"nid{i:06d}" for i in range(50)]
    assert all(e.reason == f"reason {int(e.node[3:])}" for e in entries)
    listing = run([str(ROOT / "isambard_sbatch"), "--list-bad"], env=env)
    assert listing.returncode == 0 and "50 node(s) excluded, 50 entries" in listing.stdout


def test_ttl_prune_update_unmark(tmp_path):
    log = BadNodeLog(tmp_path / "bad.log", ttl_days=7)
    log.mark("nid[001-002]", "GPU ECC")
    old = Entry(dt.datetime.now(dt.timezone.utc).replace(microsecond=0) - dt.timedelta(days=8), "nid999", "bob",
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


@pytest.mark.parametrize("node", ["nid001;reboot", "$(id)", "a b", "`x`", "nid[1-", "'"])
def test_hostile_names_refused_and_nothing_written(tmp_path, pipeline_env, node):
    log = tmp_path / "bad.log"
    res = run([str(ROOT / "isambard_sbatch"), "--mark-bad", node, "x"], env={**pipeline_env, "BAD_NODES_LOG": str(log)})
    assert res.returncode == 2 and "invalid node name" in res.stderr
    assert not log.exists() or log.read_text() == ""


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
    assert cmd == ["sbatch", "--nodes=2", "--exclude=nid000007,nid010,nid011", "job.sbatch", "arg"]
    assert capsys.readouterr().err.count("skipping malformed line") == 3
    with pytest.raises(UserError, match="invalid --exclude"):
        sbatch_cli.build_submission(["--exclude=a;b", "job.sbatch"])


def test_training_submission_runs_preflight(monkeypatch, tmp_path):
    monkeypatch.setenv("BAD_NODES_LOG", str(tmp_path / "bad.log"))
    monkeypatch.setattr(sbatch_cli, "cluster_nodes", lambda: None)
    with pytest.raises(UserError, match=r"tp\(1\) \* ep\(8\) = 8 > gpus_per_node\(4\)"):
        sbatch_cli.build_submission(["--nodes=16", "pipeline_training_submit.sbatch",
                                     "configs/quickstart/nemotron_nano_quickstart_sft.yaml", "nano", "sft",
                                     "--no-path-checks", "model.expert_model_parallel_size=8"])
