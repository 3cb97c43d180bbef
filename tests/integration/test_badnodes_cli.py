"""The shared bad-node log through the real isambard_sbatch: concurrent writers, TTL, CRUD, hostile input
never reaches sbatch (moved from tests/unit/test_badnodes.py: these tests run the script)."""

import concurrent.futures as cf
import datetime as dt
import os
import stat

import pytest

from pipeline.slurm.badnodes import BadNodeLog
from tests.helpers import ROOT, run


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


@pytest.mark.parametrize("node", ["nid001;reboot", "$(id)", "a b", "`x`", "nid[1-", "'"])
def test_hostile_names_refused_and_nothing_written(tmp_path, pipeline_env, node):
    log = tmp_path / "bad.log"
    res = run([str(ROOT / "isambard_sbatch"), "--mark-bad", node, "x"], env={**pipeline_env, "BAD_NODES_LOG": str(log)})
    assert res.returncode == 2 and "invalid node name" in res.stderr
    assert not log.exists() or log.read_text() == ""


SBATCH = str(ROOT / "isambard_sbatch")


# ---- the log is the team's file: rewrites keep mode, group, comments; no-op rewrites do not touch it ----
def _team_log(path):
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    old = (now - dt.timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    new = (now - dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    path.write_bytes(
        b"# team bad-node log - do not delete this header\n"
        + f"{new}\tnid000001\talice\tlogin1\tGPU ECC\n".encode()
        + b"hand-edited note without tabs\n"
        + b"\xff\xfe not utf-8 at all\n"
        + f"{old}\tnid000002\tbob\tlogin2\tXid 79\n".encode()
        + b"# trailing comment\n")
    os.chmod(path, 0o664)
    return path


def _env(pipeline_env, log, **kw):
    return {**pipeline_env, "BAD_NODES_LOG": str(log), **kw}


def test_unmark_of_an_absent_node_leaves_the_log_byte_identical(tmp_path, pipeline_env):
    log = _team_log(tmp_path / "bad.log")
    before, st = log.read_bytes(), log.stat()
    os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # so a rewrite would show in the mtime
    st = log.stat()
    for args in (["--unmark-bad", "nid000999"], ["--update-bad", "nid000001", "GPU ECC"], ["--prune-bad"]):
        res = run([SBATCH, *args], env=_env(pipeline_env, log, BAD_NODES_TTL_DAYS="365"))
        assert res.returncode in (0, 2) and "Traceback" not in res.stderr, res.stderr
        assert log.read_bytes() == before, args
        assert log.stat().st_mtime_ns == st.st_mtime_ns and stat.S_IMODE(log.stat().st_mode) == 0o664


def test_rewrites_keep_comments_unparsed_lines_mode_and_group(tmp_path, pipeline_env):
    log = _team_log(tmp_path / "bad.log")
    gid = next((g for g in os.getgroups() if g != os.getgid()), os.getgid())
    os.chown(log, -1, gid)
    lines = log.read_bytes().splitlines(keepends=True)
    res = run([SBATCH, "--prune-bad"], env=_env(pipeline_env, log))  # drops the 30-day-old nid000002
    assert res.returncode == 0 and "pruned 1 entry" in res.stdout, res.stderr
    assert log.read_bytes() == b"".join(lines[:4] + lines[5:])
    res = run([SBATCH, "--update-bad", "nid000001", "Xid 48"], env=_env(pipeline_env, log))
    assert res.returncode == 0, res.stderr
    after = log.read_bytes().splitlines(keepends=True)
    assert after[0] == lines[0] and after[2:] == [lines[2], lines[3], lines[5]]
    assert after[1].endswith(b"\tnid000001\talice\tlogin1\tXid 48\n")
    res = run([SBATCH, "--unmark-bad", "nid000001"], env=_env(pipeline_env, log))
    assert res.returncode == 0, res.stderr
    assert log.read_bytes() == b"".join([lines[0], lines[2], lines[3], lines[5]])
    st = log.stat()
    assert stat.S_IMODE(st.st_mode) == 0o664 and st.st_gid == gid


def test_read_only_and_unreadable_logs_are_one_line_refusals(tmp_path, pipeline_env):
    log = _team_log(tmp_path / "bad.log")
    before = log.read_bytes()
    os.chmod(log, 0o444)
    for args in (["--unmark-bad", "nid000001"], ["--prune-bad"], ["--update-bad", "nid000001", "x"],
                 ["--mark-bad", "nid000005", "x"]):
        res = run([SBATCH, *args], env=_env(pipeline_env, log))
        assert res.returncode == 2 and res.stderr.count("error:") == 1 and "read-only" in res.stderr, res.stderr
        assert log.read_bytes() == before and stat.S_IMODE(log.stat().st_mode) == 0o444
    d = tmp_path / "dir.log"
    d.mkdir()
    res = run([SBATCH, "--list-bad"], env=_env(pipeline_env, d))
    # a directory is named as one (aea45d3), in one line, with the file to point at instead
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith(f"error: the bad-node log {d} is a directory;"), res.stderr


@pytest.mark.parametrize("ttl", ["0", "-1", "nan", "inf", "-inf", "seven"])
def test_ttl_must_be_finite_and_positive(tmp_path, pipeline_env, ttl):
    log = _team_log(tmp_path / "bad.log")
    before = log.read_bytes()
    res = run([SBATCH, "--prune-bad"], env=_env(pipeline_env, log, BAD_NODES_TTL_DAYS=ttl))
    assert res.returncode == 2 and res.stderr.count("error:") == 1 and "BAD_NODES_TTL_DAYS" in res.stderr
    assert log.read_bytes() == before


def test_future_entries_are_flagged_and_stay_active(tmp_path, pipeline_env):
    log = tmp_path / "bad.log"
    log.write_text("2099-01-01T00:00:00Z\tnid000003\tbob\tlogin1\tclock skew\n")
    res = run([SBATCH, "--list-bad"], env=_env(pipeline_env, log))
    assert res.returncode == 0
    assert any(ln.startswith("! nid000003") for ln in res.stdout.splitlines()), res.stdout
    assert "dated in the future" in res.stderr and "1 node(s) excluded" in res.stdout
    assert run([SBATCH, "--prune-bad"], env=_env(pipeline_env, log)).returncode == 0
    assert "nid000003" in log.read_text()


def test_mark_is_bounded_and_ascii_only(tmp_path, pipeline_env):
    log = tmp_path / "bad.log"
    res = run([SBATCH, "--mark-bad", "nid[0-99999]", "typo"], env=_env(pipeline_env, log))
    assert res.returncode == 2 and "at most 512" in res.stderr and not log.exists()
    res = run([SBATCH, "--mark-bad", "nid[\u0661-\u0663]", "arabic digits"], env=_env(pipeline_env, log))
    assert res.returncode == 2 and "invalid node name" in res.stderr
    assert run([SBATCH, "--mark-bad", "nid[1-512]", "ok"], env=_env(pipeline_env, log)).returncode == 0
    assert len(BadNodeLog(log).entries()) == 512


def test_control_characters_neither_forge_nor_lose_entries(tmp_path, pipeline_env):
    log = tmp_path / "bad.log"
    env = _env(pipeline_env, log, LOGNAME="ev\til\n2026-01-01T00:00:00Z", USER="x")
    reason = "a\tb\nnid000666\tforged\x1b[31m red \u2028 split\x85end"
    res = run([SBATCH, "--mark-bad", "nid000010", reason], env=env)
    assert res.returncode == 0, res.stderr
    raw = log.read_text()
    assert raw.count("\n") == 1 and raw.count("\t") == 4
    (e,) = BadNodeLog(log).entries()
    assert e.node == "nid000010" and "\t" not in e.user and "\n" not in e.user
    assert "\x1b" not in e.reason and "nid000666" in e.reason  # kept as text, not as an entry
    with open(log, "a") as f:  # a hand-written entry with an ANSI escape in its reason
        f.write("2026-11-30T00:00:00Z\tnid000011\tbob\th\t\x1b[2J\x1b[31mcleared\n")
    listing = run([SBATCH, "--list-bad"], env=_env(pipeline_env, log))
    assert listing.returncode == 0 and "\x1b" not in listing.stdout and "\\x1b[31mcleared" in listing.stdout
