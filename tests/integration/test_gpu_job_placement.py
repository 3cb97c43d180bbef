"""The real 2-node launch line of a Megatron-layout coherence job, on the local Slurm: it starts the right ranks on
each node, in the positions megatron-core gives them.

One job (module fixture ``placement``) does what pipeline_coherence_submit.sbatch does, with the generation
replaced by a stand-in: in a 2-node allocation it plans ``pipeline_coherence_test.py CKPT --backend megatron
--hf-model ID --tp 2 --pp 2 --ep 2`` (the dry run, JSON), then runs one task per node (``srun
--ntasks-per-node=1``, through pipeline_env_exec.sh) that plans again on its node - as each node's
``pipeline.cli.coherence`` does before it execs torchrun - and execs that plan's launch line unchanged but for the
module: ``-m tests.slurm.rank_probe`` instead of ``-m pipeline.cli.coherence``, same arguments. Every rank
initialises gloo, takes its position from megatron-core's ``parallel_state`` (megatron-site of the Bridge harness
venv on PYTHONPATH) and writes one JSON line (tests/slurm/rank_probe.py).

The cluster profile is local_cpu's with ``gpus_per_node: 2``: a megatron plan refuses a profile without GPUs, and
2 "GPUs" per node (CPU processes here) make the layout (world = pp x lcm(tp, ep) = 4) span 2 nodes.
"""

from __future__ import annotations

import json
import re

import pytest

from pipeline.config.parallel import Layout
from tests.helpers import ROOT, megatron_checkpoint, run
from tests.integration.test_slurm import job_state, wait_job
from tests.tiers import tier_unavailable

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TP, PP, EP = 2, 2, 2
WORLD, NODES, PER_NODE = 4, 2, 2
HF_MODEL = "pipeline/tiny-qwen3-moe"  # a registry MoE model: the plan knows its size (no download: plan only)
MEGATRON_SITE = ROOT / ".cache" / "bridge-venv" / "megatron-site"  # tests/bridge/setup_env.sh builds it
JOB_TIMEOUT_S = 150  # the job itself takes ~20-30 s on 2 shared cores (4 ranks importing megatron-core)

# The batch script: the allocation's plan once, then one task per node running node.sh.
JOB_SH = """#!/usr/bin/env bash
set -euo pipefail
OUT=$1; shift
cd "$PIPELINE_ROOT"
echo "$SLURM_JOB_NODELIST" > "$OUT/nodelist"
bash pipeline_env_exec.sh -- python pipeline_coherence_test.py "$@" --dry-run --json > "$OUT/plan.json"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash pipeline_env_exec.sh -- bash "$OUT/node.sh" "$OUT" "$@"
"""
# Each node: its own plan (what pipeline.cli.coherence computes there), and its launch line with the probe's module.
NODE_SH = """#!/usr/bin/env bash
set -euo pipefail
OUT=$1; shift
PLAN="$OUT/plan-node$SLURM_NODEID.json"
python pipeline_coherence_test.py "$@" --dry-run --json > "$PLAN"
python - "$PLAN" > "$PLAN.launch" <<'EOF'
import json, sys
launch = json.load(open(sys.argv[1]))["launch"]
i = launch.index("-m")
if launch[i + 1] != "pipeline.cli.coherence":
    sys.exit(f"the plan's launch line does not run -m pipeline.cli.coherence: {launch}")
launch[i + 1] = "tests.slurm.rank_probe"
sys.stdout.write("".join(a + "\\0" for a in launch))
EOF
mapfile -d '' LAUNCH < "$PLAN.launch"
exec "${LAUNCH[@]}"
"""


def gpu_profile_text(name: str) -> str:
    """configs/cluster/local_cpu.yaml with 2 GPUs per node (and its own name): everything else the local one."""
    text = (ROOT / "configs" / "cluster" / "local_cpu.yaml").read_text()
    for pattern, repl in ((r"^name: local_cpu$", f"name: {name}"), (r"^gpus_per_node: 0$", "gpus_per_node: 2"),
                          (r"^description: .*$", 'description: "the local CPU profile with 2 GPUs per node"')):
        text, n = re.subn(pattern, repl, text, flags=re.M)
        assert n == 1, f"configs/cluster/local_cpu.yaml has no line {pattern!r} (its format changed?)"
    return text



def _node_addr(env: dict, node: str) -> str:
    out = run(["scontrol", "show", "node", node, "-o"], env=env, timeout=30, check=True).stdout
    return re.search(r"\bNodeAddr=(\S+)", out).group(1)


@pytest.fixture(scope="module")
def placement(slurm, tmp_path_factory):
    """Runs the job once; returns its plans, rank records, allocation facts and log."""
    tmp = tmp_path_factory.mktemp("placement")
    profile = tmp / "gpu2_cpu.yaml"
    profile.write_text(gpu_profile_text("gpu2_cpu"))
    (tmp / "job.sh").write_text(JOB_SH)
    (tmp / "node.sh").write_text(NODE_SH)
    # its tensors are never read (the probe stands in for the generation); the plan checks it holds a complete
    # iteration (issue 34), so it has one: the file names only
    ckpt = megatron_checkpoint(tmp / "ckpt")
    records = tmp / "ranks.ndjson"
    env = {**slurm, "PIPELINE_ROOT": str(ROOT), "PIPELINE_CLUSTER": str(profile), "RANK_PROBE_OUT": str(records),
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PIPELINE_BAD_NODES_LOG": str(tmp / "bad_nodes.log")}
    if MEGATRON_SITE.is_dir():
        env["PYTHONPATH"] = str(MEGATRON_SITE) + (f":{slurm['PYTHONPATH']}" if slurm.get("PYTHONPATH") else "")
    args = [str(ckpt), "--backend", "megatron", "--hf-model", HF_MODEL, "--tp", str(TP), "--pp", str(PP),
            "--ep", str(EP)]
    log = tmp / "job.out"
    # --gpus-per-node=2: what isambard_sbatch adds for this profile (the local Slurm's GPUs are fake gres)
    job = run(["sbatch", "--parsable", f"--nodes={NODES}", "--ntasks-per-node=1", "--gpus-per-node=2", "--time=3",
               "--job-name=placement", f"--chdir={ROOT}", f"--output={log}", str(tmp / "job.sh"), str(tmp), *args],
              env=env, timeout=60, check=True).stdout.strip().split(";")[0]
    try:
        state = wait_job(env, job, timeout=JOB_TIMEOUT_S)
    finally:
        if job_state(env, job) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            run(["scancel", job], env=env, timeout=30)
    text = log.read_text() if log.exists() else "(no job log)"
    assert state == "COMPLETED", f"job {job} {state}:\n{text[-6000:]}"
    nodelist = run(["scontrol", "show", "hostnames", (tmp / "nodelist").read_text().strip()], env=env, timeout=30,
                   check=True).stdout.split()
    return {"job": job, "args": args, "log": text, "nodelist": nodelist, "first_addr": _node_addr(env, nodelist[0]),
            "plan": json.loads((tmp / "plan.json").read_text()),
            "node_plans": [json.loads((tmp / f"plan-node{i}.json").read_text()) for i in range(NODES)],
            "records": [json.loads(x) for x in records.read_text().splitlines() if x.strip()]}


def test_plan_is_a_two_node_torchrun_line_with_the_allocations_rendezvous(placement):
    """The allocation's dry run plans 2 nodes x 2 ranks, and a torchrun line per node: --nnodes=2
    --nproc-per-node=2, a c10d rendezvous whose endpoint is the NodeAddr of the allocation's first node and whose
    id is the job's, then -m pipeline.cli.coherence with the arguments as given. Each node's own plan (made in its
    srun task, as pipeline.cli.coherence plans before it execs) is the same line: the nodes meet in one rendezvous."""
    plan = placement["plan"]
    assert plan["ok"], plan["problems"]
    assert (plan["world_size"], plan["nodes"], plan["procs_per_node"]) == (WORLD, NODES, PER_NODE)
    assert (plan["tp"], plan["pp"], plan["ep"], plan["etp"], plan["cp"], plan["dp"]) == (TP, PP, EP, 1, 1, 1)
    launch = plan["launch"]
    i = launch.index("-m")
    assert launch[i:] == ["-m", "pipeline.cli.coherence", *placement["args"]], launch
    assert launch[0] == "torchrun", launch
    opts = dict(o.split("=", 1) for o in launch[1:i])
    assert len(opts) == i - 1, launch  # every option once, each --key=value
    host, _, port = opts.pop("--rdzv-endpoint", "").rpartition(":")
    assert host == placement["first_addr"] and port.isdigit() and 0 < int(port) < 65536, launch
    assert opts == {"--nnodes": str(NODES), "--nproc-per-node": str(PER_NODE), "--rdzv-backend": "c10d",
                    "--rdzv-id": placement["job"]}, launch
    for node_plan in placement["node_plans"]:
        assert node_plan["launch"] == launch and node_plan["ok"], node_plan


def test_each_node_runs_a_contiguous_block_of_ranks_in_megatron_positions(placement):
    """Ranks 0-3 each report exactly once, with the plan's arguments. Node n's torchrun runs ranks 2n, 2n+1 (local
    ranks 0, 1; torchrun's group rank n), the two blocks on the allocation's two different nodes (which node gets
    which block is the rendezvous's choice). Each rank's tp/pp/ep/dp (and cp, etp) position is the plan's,
    ``Layout(4, tp=2, pp=2, ep=2, etp=1).positions(2)``, and its tp, pp and ep groups are live gloo communicators
    holding the plan's members (the all-reduced sum of their global ranks; the pp group spans the two nodes)."""
    recs = placement["records"]
    assert sorted(r["rank"] for r in recs) == list(range(WORLD)), recs
    lay = Layout(WORLD, tp=TP, pp=PP, ep=EP, etp=1)
    expected = lay.positions(PER_NODE)
    groups = lay.groups()
    block_nodes: dict[int, set[str]] = {}
    for rec in recs:
        r = rec["rank"]
        want = expected[r]
        assert rec["argv"] == placement["args"] and rec["job_id"] == placement["job"], rec
        assert (rec["world_size"], rec["local_world_size"]) == (WORLD, PER_NODE), rec
        assert (rec["group_rank"], rec["local_rank"]) == (want["node"], want["local_rank"]) == (r // PER_NODE,
                                                                                                 r % PER_NODE), rec
        assert rec["node"] == placement["nodelist"][int(rec["slurm_node_id"])], rec
        block_nodes.setdefault(r // PER_NODE, set()).add(rec["node"])
        got = {k: rec[k] for k in ("tp", "pp", "ep", "dp", "cp", "etp")}
        assert got == {k: want[k] for k in got}, (rec["source"], r, got, want)
        for name in ("tp", "pp", "ep"):
            members = next(g for g in groups[name] if r in g)
            assert rec["sums"][name] == sum(members), (rec["source"], r, name, members, rec["sums"])
    assert all(len(nodes) == 1 for nodes in block_nodes.values()), block_nodes
    assert sorted(n for nodes in block_nodes.values() for n in nodes) == sorted(placement["nodelist"]), block_nodes


@pytest.mark.bridge
def test_positions_come_from_megatron_cores_parallel_state(placement):
    """The positions checked above are megatron-core's own (``parallel_state.initialize_model_parallel`` on the
    gloo world and its ``get_*_rank()``), not the plan's mapping read back: every rank says source megatron-core.
    megatron-core comes from the Bridge harness venv (tests/bridge/setup_env.sh, the bridge tier)."""
    if not (MEGATRON_SITE / "megatron" / "core" / "parallel_state.py").is_file():
        tier_unavailable("bridge", f"megatron-core is not installed in {MEGATRON_SITE} (bash tests/bridge/setup_env.sh "
                                   "builds it): the ranks' positions were the plan's own mapping")
    bad = [r for r in placement["records"] if r["source"] != "megatron-core"]
    assert not bad, f"megatron-core did not initialise on gloo/CPU: {bad[0].get('megatron_error')}"
    assert len(placement["records"]) == WORLD
