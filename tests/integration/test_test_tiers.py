"""The test tiers themselves: the local Slurm finds free ports and keeps to its own cluster, and a tier that
cannot start fails a CI run (tests/run.sh and the pytest fixtures alike) instead of being skipped."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, run
from tests.tiers import TIERS

LOCAL_SLURM = ROOT / "tests" / "slurm" / "local_slurm.sh"
DEFAULT_PORTS = (16817, 17001, 17002, 17003, 17004)  # the ports the script used before it chose free ones


@contextlib.contextmanager
def held_ports(ports):
    """Listeners on the given ports (those another process already holds are held anyway, by it)."""
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            try:
                s.bind(("", port))
                s.listen()
                socks.append(s)
            except OSError:
                s.close()
        yield [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def no_tier_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PIPELINE_REQUIRE_TIERS")}
    return {**env, **extra}


def conf_ports(conf: Path) -> list[int]:
    text = conf.read_text()
    return [int(p) for p in re.findall(r"^SlurmctldPort=(\d+)$", text, re.M) + re.findall(r" Port=(\d+) ", text)]


@pytest.mark.slurm
def test_a_second_cluster_takes_free_ports_and_stop_keeps_to_its_own(slurm):
    """With the old fixed ports held by listeners of this test, a second cluster comes up on other ports and runs
    a 2-node step; stopping it leaves the test run's own cluster and its running job step alone."""
    first = slurm
    job = run(["sbatch", "--parsable", "-N2", "--output=/dev/null", "--wrap", "srun sleep 120"], env=first,
              check=True).stdout.strip()
    base = Path(tempfile.mkdtemp(prefix="pst.", dir="/tmp"))
    env2 = {**no_tier_env(PIPELINE_SLURM_BASE=str(base)), "SLURM_CONF": str(base / "etc" / "slurm.conf")}
    try:
        with held_ports(DEFAULT_PORTS):
            res = run(["bash", str(LOCAL_SLURM), "start"], env={k: v for k, v in env2.items() if k != "SLURM_CONF"})
            assert res.returncode == 0, res.stderr[-2000:]
            ports = conf_ports(base / "etc" / "slurm.conf")
            assert len(ports) == 5 and len(set(ports)) == 5 and not set(ports) & set(DEFAULT_PORTS), ports
            assert ports != conf_ports(Path(first["SLURM_CONF"]))
            step = run(["srun", "-N2", "--time=2", "hostname"], env=env2, timeout=120)
            assert step.returncode == 0 and len(step.stdout.split()) == 2, step
        for _ in range(40):  # the first cluster's step is running (its slurmstepd exists) before the stop
            if run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], env=first).stdout.strip():
                break
            subprocess.run(["sleep", "0.5"])
        stop = run(["bash", str(LOCAL_SLURM), "stop"], env=env2)
        assert stop.returncode == 0, stop.stderr
        state = run(["squeue", "-h", "-j", job, "-o", "%T"], env=first).stdout.strip()
        assert state == "RUNNING", f"the other cluster's stop touched this cluster's job {job}: {state!r}"
        assert run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], env=first).stdout.strip(), "its step was killed"
    finally:
        run(["scancel", job], env=first)
        run(["bash", str(LOCAL_SLURM), "stop"], env=env2)
        subprocess.run(["rm", "-rf", str(base)])


@pytest.mark.slurm
def test_a_fixed_port_in_use_is_one_line(slurm, tmp_path):
    base = Path(tempfile.mkdtemp(prefix="pst.", dir="/tmp"))
    try:
        with held_ports([free_port()]) as (port,):
            res = run(["bash", str(LOCAL_SLURM), "start"],
                      env=no_tier_env(PIPELINE_SLURM_BASE=str(base), SLURMCTLD_PORT=str(port)))
        assert res.returncode == 1
        assert res.stderr.strip().splitlines()[-1] == (
            f"local_slurm: error: port {port} (SLURMCTLD_PORT) is already in use (Address already in use)")
    finally:
        subprocess.run(["rm", "-rf", str(base)])


@pytest.mark.slurm
def test_a_ci_run_whose_slurm_tier_cannot_start_fails(slurm, tmp_path):
    """tests/run.sh as CI runs it (CI=true), with the controller's port taken: exit 1 with the tier's one line, and
    pytest never runs. Outside CI the same start is a warning and the tests run without the tier."""
    base = Path(tempfile.mkdtemp(prefix="pst.", dir="/tmp"))
    args = ["bash", "tests/run.sh", "--co", "-q", "tests/unit/test_hostlist.py"]
    try:
        with held_ports([free_port()]) as (port,):
            env = no_tier_env(PIPELINE_SLURM_BASE=str(base), SLURMCTLD_PORT=str(port))
            ci = run(args, env={**env, "CI": "true"}, timeout=600)
            local = run(args, env=env, timeout=600)
            named = run(args, env={**env, "PIPELINE_REQUIRE_TIERS": "slurm"}, timeout=600)
        assert ci.returncode == 1, ci.stdout[-2000:] + ci.stderr[-2000:]
        assert ci.stderr.strip().splitlines()[-1] == (
            f"error: test tier slurm cannot start: port {port} (SLURMCTLD_PORT) is already in use "
            "(Address already in use) [required: CI=true or PIPELINE_REQUIRE_TIERS]")
        assert "collected" not in ci.stdout and "test_hostlist" not in ci.stdout
        assert local.returncode == 0, local.stderr[-2000:]
        assert "warning: test tier slurm cannot start: port" in local.stderr and "test_hostlist.py" in local.stdout
        assert named.returncode == 1 and "error: test tier slurm cannot start" in named.stderr
    finally:
        subprocess.run(["rm", "-rf", str(base)])


def pytest_in_subprocess(env: dict, *args: str) -> subprocess.CompletedProcess:
    return run(["python", "-m", "pytest", "-p", "no:cacheprovider", *args], env=env, timeout=600)


def test_a_required_tier_fails_where_it_would_skip(tmp_path):
    """The pytest side: a slurm test whose cluster cannot start (its base directory cannot be made) is skipped with
    the tier's line outside CI and fails with it under CI=true; the tier summary comes before pytest's last line."""
    test = "tests/integration/test_sbatch_options.py::test_unknown_option_is_refused_before_sbatch"
    env = no_tier_env(PIPELINE_SLURM_BASE="/dev/null/pslurm")
    env.pop("SLURM_CONF", None)
    local = pytest_in_subprocess(env, "-rs", test)
    assert local.returncode == 0, local.stdout[-3000:]
    assert "test tier slurm cannot start: cannot create the cluster's base directory /dev/null/pslurm" in local.stdout
    lines = local.stdout.strip().splitlines()
    summary = [i for i, line in enumerate(lines) if re.fullmatch(r"tier slurm: 0 passed, 0 failed, 1 skipped; wall "
                                                                  r"\d+\.\d s", line)]
    assert summary and re.match(r"=+ 1 skipped", lines[-1]), lines[-8:]
    assert summary[0] < len(lines) - 1
    ci = pytest_in_subprocess({**env, "CI": "true"}, test)
    assert ci.returncode == 1, ci.stdout[-3000:]
    assert "test tier slurm cannot start: cannot create the cluster's base directory" in ci.stdout
    assert "tier slurm: 0 passed, 1 failed, 0 skipped (required)" in ci.stdout
    assert re.search(r"=+ 1 error", ci.stdout.strip().splitlines()[-1])


def test_a_skip_inside_a_required_tier_fails_whoever_raises_it(tmp_path):
    """The safety net: a test of a required tier that calls pytest.skip itself fails with the reason; the gpu tier
    is exempt on a machine without a GPU, even when required, and says so."""
    case = tmp_path / "test_case.py"
    case.write_text("import pytest\n\n@pytest.mark.bridge\ndef test_x():\n    pytest.skip('wheel cache empty')\n\n"
                    "@pytest.mark.gpu\ndef test_g():\n    pass\n\ndef test_plain():\n    import time\n"
                    "    time.sleep(0.6)\n")
    args = ["-c", str(ROOT / "pytest.ini"), "-p", "tests.conftest", str(case)]  # the hooks, loaded as a plugin
    req = pytest_in_subprocess(no_tier_env(PIPELINE_REQUIRE_TIERS="bridge"), *args)
    assert req.returncode == 1 and "required test tier bridge skipped a test: wheel cache empty" in req.stdout
    assert "tier bridge: 0 passed, 1 failed, 0 skipped (required)" in req.stdout
    assert "tier untiered: 1 passed, 0 failed, 0 skipped" in req.stdout
    if "exempt: no GPU" in req.stdout:
        assert "tier gpu: 0 passed, 0 failed, 1 skipped; exempt: no GPU on this machine" in req.stdout
        every = pytest_in_subprocess(no_tier_env(PIPELINE_REQUIRE_TIERS="all"), *args, "-k", "test_g")
        assert every.returncode == 0 and "1 skipped" in every.stdout, every.stdout[-2000:]
    plain = pytest_in_subprocess(no_tier_env(), *args)
    assert plain.returncode == 0 and "tier bridge: 0 passed, 0 failed, 1 skipped" in plain.stdout
    # each tier's wall time: the seconds its tests took (test_plain sleeps 0.6 s; the tiers without tests 0.0 s)
    walls = dict(re.findall(r"^tier (\w+): .*; wall (\d+\.\d) s$", plain.stdout, re.M))
    assert set(walls) == {*TIERS, "untiered"}, plain.stdout[-2000:]
    assert 0.6 <= float(walls["untiered"]) < 30 and float(walls["slurm"]) == 0.0, walls
    bad = pytest_in_subprocess(no_tier_env(PIPELINE_REQUIRE_TIERS="slurm,gpus"), *args)
    assert bad.returncode == 4 and "PIPELINE_REQUIRE_TIERS names unknown tier(s) gpus" in bad.stderr
