"""A team on one cluster (issue 59): what one member creates under the default umask 022, another member of the same
group reads, writes and locks. Two real users (pipeline-alice, pipeline-bob, both in the group pipeline-team, each
with a private primary group) run the team's checkout from a shared directory set up as docs/cluster.md says
(group pipeline-team, mode 2775), with the login node's world: /usr/bin/python3 and the planner, no pipeline venv.

Needs root (to create the two users and switch to them with setpriv); CI runs as root."""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

TEAM, ALICE, BOB = "pipeline-team", "pipeline-alice", "pipeline-bob"
LOGIN_PATH = "/usr/bin:/bin"  # a login node: the system python3 and the planner, nothing of the dev venv
NANO = ["pipeline_training_submit.sbatch", "configs/quickstart/nemotron_nano_quickstart_sft.yaml", "nano", "sft",
        "model.tensor_model_parallel_size=4", "model.expert_model_parallel_size=8"]


def _ensure_members() -> None:
    """The group and its two members (system accounts, no home, no login), made once per machine."""
    if os.geteuid() != 0:
        pytest.skip("the team tests switch between two real users: they need root (CI runs as root)")
    for tool in ("setpriv", "useradd", "groupadd"):
        if not shutil.which(tool):
            pytest.fail(f"{tool} is missing: the team tests need util-linux's setpriv and shadow's useradd")
    try:
        grp.getgrnam(TEAM)
    except KeyError:
        subprocess.run(["groupadd", "--system", TEAM], check=True)
    for user in (ALICE, BOB):
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/bin/bash",
                            "--groups", TEAM, user], check=True)


class Member:
    def __init__(self, name: str, team: Path):
        pw = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, pw.pw_uid, pw.pw_gid
        self.team_gid = grp.getgrnam(TEAM).gr_gid
        self.home = team / "home" / name
        self.home.mkdir(parents=True)
        os.chown(self.home, self.uid, self.gid)
        os.chmod(self.home, 0o700)  # a home only its owner may enter, as on a cluster

    def run(self, cmd: list[str], env: dict, cwd: Path, umask: str = "022") -> subprocess.CompletedProcess:
        """``cmd`` as this member: their uid, their primary group plus the team's, the default umask."""
        full = {"PATH": LOGIN_PATH, "HOME": str(self.home), "LOGNAME": self.name, "USER": self.name, "LANG": "C.UTF-8",
                **env}
        return subprocess.run(["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                               f"--groups={self.gid},{self.team_gid}", "--inh-caps=-all", "--",
                               "bash", "-c", f"umask {umask}; exec \"$@\"", "member", *cmd],
                              env=full, cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.fixture
def team():
    """A team directory readable by everyone: the team's checkout (this working tree's tracked files, copied: the
    test's own checkout may sit under a folder other users cannot enter) and ``shared/``, set up as docs/cluster.md
    says (group pipeline-team, setgid, 2775)."""
    _ensure_members()
    base = Path(tempfile.mkdtemp(prefix="pteam.", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        checkout = base / "checkout"
        for rel in filter(None, files.decode().split("\0")):
            src = ROOT / rel
            if src.is_file():
                (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, checkout / rel)
        subprocess.run(["chmod", "-R", "a+rX", str(checkout)], check=True)
        shared = base / "shared"
        shared.mkdir()
        os.chown(shared, 0, grp.getgrnam(TEAM).gr_gid)
        os.chmod(shared, 0o2775)
        yield {"base": base, "checkout": checkout, "shared": shared, "alice": Member(ALICE, base),
               "bob": Member(BOB, base)}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _sbatch(team, who: str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    member = team[who]
    base_env = {"PIPELINE_VENV": str(team["base"] / "no-venv"), "BAD_NODES_LOG": str(team["shared"] / "bad_nodes.log"),
                "PIPELINE_RUNS_DIR": str(team["shared"] / "runs")}
    return member.run([str(team["checkout"] / "isambard_sbatch"), *args], {**base_env, **(env or {})},
                      cwd=team["checkout"])


def test_a_teammate_marks_updates_unmarks_and_prunes_what_another_created(team):
    """The reference's promise: once a teammate reports a bad node, nobody else lands on it, and anyone can update
    the report. Alice's first --mark-bad creates the log and its lock under umask 022; Bob changes every entry."""
    log, lock = team["shared"] / "bad_nodes.log", team["shared"] / "bad_nodes.log.lock"
    res = _sbatch(team, "alice", "--mark-bad", "nid[000001-000003]", "GPU ECC (Xid 48)")
    assert res.returncode == 0, res.stderr
    team_gid = grp.getgrnam(TEAM).gr_gid
    for path in (log, lock):  # group-writable whatever alice's umask; the team's group from the setgid directory
        st = path.stat()
        assert st.st_uid == pwd.getpwnam(ALICE).pw_uid and st.st_gid == team_gid, (path, st)
        assert _mode(path) == 0o664, (path, oct(_mode(path)))
    for args in (["--mark-bad", "nid000004", "NCCL timeout"], ["--update-bad", "nid000001", "fixed? retest"],
                 ["--unmark-bad", "nid000002"], ["--prune-bad"]):
        res = _sbatch(team, "bob", *args)
        assert res.returncode == 0 and "error" not in res.stderr, (args, res.stderr)
    listing = _sbatch(team, "bob", "--list-bad")
    assert listing.returncode == 0, listing.stderr
    assert "3 node(s) excluded" in listing.stdout, listing.stdout
    rows = {line.split("\t")[1]: line.split("\t") for line in log.read_text().splitlines()}
    assert set(rows) == {"nid000001", "nid000003", "nid000004"}
    assert rows["nid000001"][2] == ALICE and rows["nid000001"][4] == "fixed? retest"  # bob's update, alice's report
    assert rows["nid000004"][2] == BOB
    # bob's atomic rewrite kept the team's file: its mode and group (the owner stays alice only where chown may)
    assert _mode(log) == 0o664 and log.stat().st_gid == team_gid
    # and alice, in turn, changes what bob wrote
    assert _sbatch(team, "alice", "--unmark-bad", "nid000004").returncode == 0
    assert "nid000004" not in log.read_text()


def test_a_log_made_before_the_fix_is_refused_with_the_fix_then_works_after_it(team):
    """A log and lock from before (mode 644, alice's private group, in alice's own directory): bob's change is one
    line naming the owner and the command that shares it; once the owner ran that on the log and its directory,
    bob's changes work although the old lock file is still 644 (flock needs no write permission)."""
    alice = team["alice"]
    own = team["shared"] / "alice-dir"
    res = alice.run(["bash", "-c", f"mkdir {own} && chgrp {alice.gid} {own} && chmod 755 {own} && "
                     f"printf '' > {own}/bad.log && printf '' > {own}/bad.log.lock"], {}, cwd=team["base"])
    assert res.returncode == 0, res.stderr
    log = own / "bad.log"
    assert _mode(log) == 0o644 and _mode(own / "bad.log.lock") == 0o644
    env = {"BAD_NODES_LOG": str(log)}
    res = _sbatch(team, "bob", "--mark-bad", "nid000007", "x", env=env)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"the bad-node log {log} is read-only (mode 644, owner {ALICE}:{ALICE})" in res.stderr, res.stderr
    assert f"chgrp TEAM {log} && chmod g+w {log}" in res.stderr, res.stderr
    assert alice.run(["chgrp", TEAM, str(log)], {}, cwd=team["base"]).returncode == 0
    assert alice.run(["chmod", "g+w", str(log)], {}, cwd=team["base"]).returncode == 0
    res = _sbatch(team, "bob", "--mark-bad", "nid000007", "x", env=env)  # an append: the log itself is enough
    assert res.returncode == 0, res.stderr
    res = _sbatch(team, "bob", "--unmark-bad", "nid000007", env=env)  # a rewrite: the directory is needed too
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"the bad-node log's directory {own} is not writable by you" in res.stderr
    assert f"chmod g+ws {own}" in res.stderr, res.stderr
    assert alice.run(["bash", "-c", f"chgrp {TEAM} {own} && chmod g+ws {own}"], {}, cwd=team["base"]).returncode == 0
    res = _sbatch(team, "bob", "--unmark-bad", "nid000007", env=env)
    assert res.returncode == 0, res.stderr
    assert log.read_text() == "" and _mode(own / "bad.log.lock") == 0o644


def test_a_teammate_takes_the_container_directorys_setup_lock(team):
    """The container directory's .setup.lock made by alice's setup is taken by bob's: bob's setup goes past the lock
    to the step itself (here the image pull, which needs apptainer, absent on this machine: that is the one line)."""
    env = {"PIPELINE_CLUSTER": "isambard_gh200", "PIPELINE_CONTAINER_DIR": str(team["shared"] / "containers"),
           "PIPELINE_SIF": str(team["shared"] / "containers" / "nemo.sif")}
    setup = [str(team["checkout"] / "pipeline_env_setup.sh"), "--only", "pull"]
    for who in ("alice", "bob"):
        res = team[who].run(["bash", *setup], env, cwd=team["checkout"])
        assert res.returncode == 1, res.stderr
        assert "apptainer not found" in res.stderr and "setup lock" not in res.stderr, res.stderr
    lock = team["shared"] / "containers" / ".setup.lock"
    assert _mode(lock) == 0o664 and _mode(lock.parent) & 0o070 == 0o070  # alice's umask 022 did not decide
    # a container directory made before the fix (alice's, 755): bob's setup names it and its fix, in one line
    old = team["shared"] / "old-containers"
    assert team["alice"].run(["bash", "-c", f"mkdir -m 755 {old} && : > {old}/.setup.lock"], {},
                             cwd=team["base"]).returncode == 0
    res = team["bob"].run(["bash", *setup], {**env, "PIPELINE_CONTAINER_DIR": str(old)}, cwd=team["checkout"])
    assert res.returncode == 1 and "error: the shared container directory" in res.stderr, res.stderr
    assert f"chmod g+ws {old}" in res.stderr and "A team on one cluster" in res.stderr, res.stderr


def test_a_planner_one_member_made_plans_for_another(team):
    """Alice makes the login node's planner in the shared container directory from the system Python; bob's
    submission runs its preflight in it (the layout refusal comes from the planner, not from a missing one). A
    planner made from a Python only its maker may run names PIPELINE_PLANNER_VENV and the command for one's own; a
    planner directory bob cannot write is refused in one line naming PIPELINE_PLANNER_VENV."""
    containers = team["shared"] / "containers"
    env = {"PIPELINE_CLUSTER": "isambard_gh200", "PIPELINE_CONTAINER_DIR": str(containers),
           "PIPELINE_PLANNER_PYTHON": "/usr/bin/python3"}
    setup = ["bash", str(team["checkout"] / "pipeline_env_setup.sh"), "--only", "planner"]
    res = team["alice"].run(setup, env, cwd=team["checkout"])
    assert res.returncode == 0, res.stderr
    assert "teammates cannot run" not in res.stderr, res.stderr
    planner = next(containers.glob("planner-*"))
    assert _mode(planner) & 0o070 == 0o070
    res = _sbatch(team, "bob", "--nodes=16", *NANO, env=env)
    assert res.returncode == 2, res.stderr
    assert "error: ep(8) * etp(1) = 8 > gpus_per_node(4) on 'isambard_gh200'" in res.stderr, res.stderr
    assert "create the planner" not in res.stderr
    # bob may also redo it (the shared planner is the team's)
    assert team["bob"].run([*setup, "--force"], env, cwd=team["checkout"]).returncode == 0

    # a private Python: a copy of the interpreter in alice's home (mode 700); the planner warns its maker
    alice = team["alice"]
    private = alice.home / "python" / "bin"
    res = alice.run(["bash", "-c", f"mkdir -p {private} && cp /usr/bin/python3.11 {private}/python3"], {},
                    cwd=team["base"])
    assert res.returncode == 0, res.stderr
    own_env = {**env, "PIPELINE_PLANNER_PYTHON": str(private / "python3"),
               "PIPELINE_PLANNER_VENV": str(containers / "alice-planner")}
    res = alice.run(setup, own_env, cwd=team["checkout"])
    assert res.returncode == 0, res.stderr
    assert f"lives under {alice.home}, which only its owner may enter: teammates cannot run this planner" \
        in res.stderr, res.stderr
    res = _sbatch(team, "bob", "--nodes=16", *NANO, env=own_env)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"the planner at {containers / 'alice-planner'} (PIPELINE_PLANNER_VENV) cannot be run by you" \
        in res.stderr, res.stderr
    assert "make your own with: PIPELINE_PLANNER_VENV=$HOME/.cache/pipeline/planner" in res.stderr, res.stderr
    # and a planner directory bob cannot write: one line naming it and PIPELINE_PLANNER_VENV
    closed = team["shared"] / "alice-only"
    assert alice.run(["mkdir", "-m", "755", str(closed)], {}, cwd=team["base"]).returncode == 0
    res = team["bob"].run(setup, {**env, "PIPELINE_PLANNER_VENV": str(closed / "planner")}, cwd=team["checkout"])
    assert res.returncode == 1 and "Permission denied" not in res.stderr, res.stderr
    assert re.search(rf"cannot write the planner's directory {closed} \(PIPELINE_PLANNER_VENV={closed}/planner\)",
                     res.stderr), res.stderr


@pytest.mark.slurm
def test_a_teammates_submission_never_lands_on_the_node_another_marked(team, slurm):
    """On the local Slurm: alice marks node1 and node2; bob's submissions (his uid, his sbatch) exclude them."""
    env = {"SLURM_CONF": slurm["SLURM_CONF"], "PIPELINE_CLUSTER": "local_cpu"}
    for node in ("node1", "node2"):
        assert _sbatch(team, "alice", "--mark-bad", node, "test: bad GPU", env=env).returncode == 0
    out = team["shared"] / "out"
    out.mkdir()
    os.chown(out, pwd.getpwnam(BOB).pw_uid, grp.getgrnam(TEAM).gr_gid)
    jobs = []
    for _ in range(3):
        res = _sbatch(team, "bob", "--parsable", "-N1", "-o", f"{out}/wrap-%j.out", "--wrap",
                      "echo NODE=$SLURMD_NODENAME", env=env)
        assert res.returncode == 0, res.stderr
        assert "Bad nodes: 2 excluded" in res.stderr, res.stderr
        jobs.append(res.stdout.strip().split(";")[0])
    nodes = set()
    for job in jobs:
        st = _wait(job, env)
        assert st == "COMPLETED", (job, st)
        nodes |= set(re.findall(r"NODE=(\S+)", (out / f"wrap-{job}.out").read_text()))
        user = subprocess.run(["scontrol", "show", "job", job, "-o"], env={**os.environ, **env}, capture_output=True,
                              text=True).stdout
        assert f"UserId={BOB}(" in user, user
    assert nodes and nodes <= {"node3", "node4"}, nodes


def _wait(job: str, env: dict) -> str:
    """The job's final state; the wait ends when Slurm says the job ended (its own time limit bounds it)."""
    import time

    while True:
        out = subprocess.run(["scontrol", "show", "job", job, "-o"], env={**os.environ, **env}, capture_output=True,
                             text=True).stdout
        m = re.search(r"JobState=(\S+)", out)
        state = m.group(1) if m else "UNKNOWN"
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "UNKNOWN"):
            return state
        time.sleep(1)


def test_a_submission_from_a_checkout_that_is_not_yours_says_where_the_log_cannot_go(team):
    """The scripts' logs/slurm/ is relative to the submission's directory: from a checkout bob cannot write, his
    submission is one line (before: a traceback from mkdir), and nothing is queued."""
    res = _sbatch(team, "bob", "--mark-bad", "nid000001", "x")
    assert res.returncode == 0, res.stderr
    res = _sbatch(team, "bob", "pipeline_env_submit.sbatch", "validate")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"the job's log would go to {team['checkout'] / 'logs' / 'slurm'}, which cannot be created here" \
        in res.stderr, res.stderr
