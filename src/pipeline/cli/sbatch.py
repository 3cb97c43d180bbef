"""isambard_sbatch - a drop-in for ``sbatch`` that keeps the team off known-bad nodes.

    isambard_sbatch [sbatch options] SCRIPT [script args]     submit, excluding every node in the shared
                                                             bad-node log younger than the TTL
    isambard_sbatch --no-preflight [sbatch options] SCRIPT    the same without the training preflight
    isambard_sbatch --mark-bad NODE [REASON]                 report a node (or hostlist nid[001-004])
    isambard_sbatch --list-bad                               list the log (active entries marked *)
    isambard_sbatch --update-bad NODE REASON                 change the reason
    isambard_sbatch --unmark-bad NODE                        remove a node (it got fixed)
    isambard_sbatch --prune-bad                              drop entries older than the TTL

The log is $BAD_NODES_LOG (else PIPELINE_BAD_NODES_LOG from pipeline_env_config.env); the TTL is
$BAD_NODES_TTL_DAYS (default 7). A user --exclude/-x is merged with the log's nodes. Training submissions
(pipeline_training_submit.sbatch) run the login-node preflight first and are refused (exit 2) when it fails,
or when it cannot run: it needs the pipeline venv or, on a cluster's login node, the planner environment
(`bash pipeline_env_setup.sh --only planner`); `--no-preflight` queues without the checks.
Only mark a node for hardware faults (GPU Xid, a tunnel that never comes up, NCCL dying on the first
collective on that node) - not for OOM, bad YAML or parallelism mistakes.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

from pipeline.common.argv import flag_value
from pipeline.common.errors import UserError, cli_main
from pipeline.config.cluster import profile_sbatch_options, script_directives  # pure; shared with the dry run
from pipeline.slurm.badnodes import from_env, is_future, printable
from pipeline.slurm.hostlist import compress, expand, is_hostlist

# The option table used when the installed sbatch's --help cannot be read (no sbatch on a laptop's dry run, or one
# that fails): Slurm 22.05's sbatch --help/--usage as parsed by sbatch_option_table, plus the value options of newer
# Slurm's manual. With it, `--tmp 10G` still takes its value (the old short list made `10G` the job script); an
# option outside it is refused unless written `--opt=value`, which cannot be misread.
BUILTIN_VALUE_OPTS = frozenset({
    "--account", "--acctg-freq", "--array", "--batch", "--bb", "--bbf", "--begin", "--chdir", "--cluster-constraint",
    "--clusters", "--comment", "--constraint", "--container-id", "--core-spec", "--cores-per-socket", "--cpu-freq",
    "--cpus-per-gpu", "--cpus-per-task", "--deadline", "--delay-boot", "--dependency", "--distribution", "--error",
    "--exclude", "--export", "--export-file", "--extra-node-info", "--gid", "--gpu-bind", "--gpu-freq", "--gpus",
    "--gpus-per-node", "--gpus-per-socket", "--gpus-per-task", "--gres", "--gres-flags", "--hint", "--input",
    "--job-name", "--kill-on-invalid-dep", "--licenses", "--mail-type", "--mail-user", "--mcs-label", "--mem",
    "--mem-bind", "--mem-per-cpu", "--mem-per-gpu", "--mincpus", "--mpi", "--network", "--nodefile", "--nodelist",
    "--nodes", "--ntasks", "--ntasks-per-core", "--ntasks-per-node", "--ntasks-per-socket", "--open-mode",
    "--output", "--partition", "--power", "--prefer", "--priority", "--profile", "--qos", "--relative",
    "--reservation", "--resv-ports", "--segment", "--signal", "--sockets-per-node", "--switches", "--thread-spec",
    "--threads-per-core", "--time", "--time-min", "--tmp", "--tres-bind", "--tres-per-task", "--uid", "--wckey",
    "--wrap", "-A", "-B", "-C", "-D", "-F", "-G", "-J", "-L", "-M", "-N", "-S", "-a", "-b", "-c", "-d", "-e", "-i",
    "-m", "-n", "-o", "-p", "-q", "-r", "-t", "-w", "-x",
})
BUILTIN_FLAGS = frozenset({
    "--container", "--contiguous", "--exclusive", "--get-user-env", "--help", "--hold", "--ignore-pbs", "--nice",
    "--no-kill", "--no-requeue", "--overcommit", "--oversubscribe", "--parsable", "--propagate", "--quiet",
    "--reboot", "--requeue", "--spread-job", "--test-only", "--usage", "--use-min-nodes", "--verbose", "--version",
    "--wait", "-H", "-O", "-Q", "-V", "-W", "-h", "-k", "-s", "-v",
})
# Above this length the exclusion goes to a file (sbatch reads --exclude=PATH when the value has a "/"):
# one argument may not exceed MAX_ARG_STRLEN (128 KiB) on Linux.
MAX_EXCLUDE_ARG = 64 * 1024
CRUD = ("--mark-bad", "--list-bad", "--update-bad", "--unmark-bad", "--prune-bad")
TRAINING_SCRIPT = "pipeline_training_submit.sbatch"
OWN_FLAGS = ("--no-preflight",)  # isambard_sbatch's options among sbatch's; never passed to sbatch
PLANNER_SETUP = "bash pipeline_env_setup.sh --only planner"


# Value options that sbatch accepts but that Slurm 22.05's --help/--usage do not list (from the sbatch manual),
# and two that --help shows as "[=...]" although sbatch requires their value (--wrap CMD, --export NAMES work
# with a space; checked on the local Slurm).
UNLISTED_VALUE_OPTS = {"--wrap", "--export", "--hint", "--open-mode", "--mem-bind", "--network", "--acctg-freq",
                       "--batch", "--tres-per-task", "--kill-on-invalid-dep", "--resv-ports", "--mpi", "--prefer",
                       "--distribution", "--clusters", "--cpus-per-gpu", "--gpus-per-node", "-r", "--relative"}
UNLISTED_FLAGS = {"--test-only", "--exclusive", "--parsable"}


@functools.lru_cache(maxsize=1)
def sbatch_option_table() -> tuple[frozenset[str], frozenset[str]] | None:
    """(options taking a value, options taking none) as the installed sbatch describes them in --help and
    --usage; None when sbatch is not installed (then the built-in table is used and nothing is refused)."""
    import re
    import subprocess

    texts = []
    for flag in ("--help", "--usage"):
        try:
            res = subprocess.run(["sbatch", flag], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        texts.append(res.stdout)
    if not any(texts):
        return None
    values, flags = set(UNLISTED_VALUE_OPTS), set()
    for line in texts[0].splitlines():  # "  -N, --nodes=N  ..." / "      --tmp=MB ..." / "  -H, --hold ..."
        m = re.match(r"^\s+(?:(-[A-Za-z])[, ]\s*)?(--[A-Za-z][\w-]*)(\[?=)?", line)
        if not m:
            continue
        short, long_, eq = m.groups()
        kind = values if eq == "=" else flags  # "--opt[=x]" takes its value only joined with "="
        kind.update(o for o in (short, long_) if o)
    for tok in re.findall(r"\[([^\[\]]*(?:\[[^\]]*\])?[^\[\]]*)\]", texts[1]):  # "[-N nnodes]" "[--mem=MB]"
        m = re.match(r"^(-[A-Za-z]|--[A-Za-z][\w-]*)(\[?=|\s+\S)?", tok.strip())
        if m:
            (values if m.group(2) and not m.group(2).startswith("[") else flags).add(m.group(1))
    flags -= values
    return frozenset(values), frozenset(flags | UNLISTED_FLAGS)


def _table(table=None) -> tuple[frozenset[str], frozenset[str], bool]:
    """(value options, flags, from the built-in table)"""
    if table is not None:
        return table[0], table[1], False
    read = sbatch_option_table()
    return (read[0], read[1], False) if read else (BUILTIN_VALUE_OPTS, BUILTIN_FLAGS, True)


def split_sbatch_args(argv: list[str], table: tuple[frozenset[str], frozenset[str]] | None = None
                      ) -> tuple[list[str], list[str], str | None, list[str]]:
    """(sbatch options without excludes, user excludes, script, script args), parsed the way sbatch's getopt
    does: which options take a value comes from the installed sbatch (``sbatch_option_table``); clustered short
    options (``-HN 2``), unique abbreviations of long options (``--job`` for ``--job-name``) and ``--`` work;
    an option sbatch does not know is refused with one line. The options come back normalised (``--long=value``,
    ``-S value``, flags alone), which sbatch reads the same way."""
    values, flags, builtin = _table(table)
    known = sorted(values | flags)
    opts: list[str] = []
    excludes: list[str] = []

    def add(name: str, value: str | None) -> None:
        if name in ("-x", "--exclude"):
            excludes.append(value or "")
        elif value is None:
            opts.append(name)
        elif name.startswith("--"):
            opts.append(f"{name}={value}")
        else:
            opts.extend([name, value])

    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return opts, excludes, (argv[i + 1] if i + 1 < len(argv) else None), argv[i + 2:]
        if not a.startswith("-") or a == "-":
            return opts, excludes, a, argv[i + 1:]
        if a in OWN_FLAGS:  # isambard_sbatch's own, exactly as written (build_submission takes them out)
            opts.append(a)
            i += 1
            continue
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if name not in values and name not in flags:
                matches = [k for k in known if k.startswith(name) and k.startswith("--")]
                if len(matches) != 1 and builtin and eq:
                    add(name, val)  # --opt=value: unambiguous, whatever the cluster's sbatch options are
                    i += 1
                    continue
                if len(matches) != 1:
                    what = f"ambiguous ({', '.join(matches[:5])})" if matches else (
                        "not in the built-in option table: sbatch --help could not be read; write it --opt=value"
                        if builtin else "not in this Slurm's sbatch --help")
                    raise UserError(f"unknown sbatch option {a!r} ({what}); check the spelling")
                name = matches[0]
            if name in values and not eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{name} needs a value")
                val, i = argv[i + 1], i + 1
            add(name, val if (eq or name in values) else None)
            i += 1
            continue
        # short options, possibly clustered: a value-taking letter takes the rest of the token or the next argument
        j = 1
        while j < len(a):
            name = "-" + a[j]
            if name in values:
                val = a[j + 1:]
                if not val:
                    if i + 1 >= len(argv):
                        raise UserError(f"{name} needs a value")
                    val, i = argv[i + 1], i + 1
                add(name, val)
                break
            if name not in flags:
                where = "the built-in option table (sbatch --help could not be read)" if builtin else \
                    "this Slurm's sbatch --help"
                raise UserError(f"unknown sbatch option {name!r} in {a!r} (not in {where})")
            add(name, None)
            j += 1
        i += 1
    return opts, excludes, None, []


def option_value(opts: list[str], *names: str) -> str | None:
    """The value of an option in normalised ``opts`` (as split_sbatch_args returns them); values of other
    options are never mistaken for options."""
    values, _, _ = _table()
    i = 0
    while i < len(opts):
        a = opts[i]
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if name in names and eq:
                return val
            i += 1
            continue
        if a in values:
            if a in names and i + 1 < len(opts):
                return opts[i + 1]
            i += 2
            continue
        i += 1
    return None


def training_preflight(script_args: list[str], opts: list[str], required: bool = True) -> str | None:
    """Run the training preflight for a pipeline_training_submit.sbatch submission; UserError on failure.
    Returns the run's name (``logger.wandb_exp_name``), or None when the preflight could not run here: that is
    refused (UserError naming the command that creates the login-node planner) unless ``required`` is False
    (``--no-preflight``)."""
    if len(script_args) < 3:
        raise UserError(f"{TRAINING_SCRIPT} needs CONFIG MODEL MODE [launcher flags] [overrides]")
    nodes = (option_value(opts, "--nodes", "-N") or "1").split("-")[0]
    if not nodes.isdigit():
        raise UserError(f"--nodes={nodes!r} is not a node count")
    config, model, mode, *rest = script_args
    argv = [config, "--model", model, "--mode", mode, "--nodes", nodes, *rest]
    if option_value(opts, "--dependency", "-d") is not None and "--no-path-checks" not in rest:
        # a job that waits for another leaves its inputs (the previous phase's checkpoint) to the job, whose launcher
        # checks them when it starts, as submit_checks does for the other pipelines
        argv.append("--no-path-checks")
    cluster = os.environ.get("PIPELINE_CLUSTER")
    if cluster and "--cluster" not in rest:
        argv += ["--cluster", cluster]
    try:
        from pipeline.cli.train import plan_from_argv  # the pipeline environment: not there on a bare login node

        launch = plan_from_argv(argv)
    except ImportError as exc:  # a login node without the pipeline venv or the planner (the container posture)
        if required:
            # The container runtime's login node gets the planner; a venv machine gets the venv itself.
            fix = (f"create the planner with: {f'PIPELINE_CLUSTER={cluster} ' if cluster else ''}{PLANNER_SETUP}"
                   if os.environ.get("PIPELINE_RUNTIME") == "apptainer" else
                   "create the pipeline venv with: bash pipeline_env_setup.sh")
            raise UserError(f"the training preflight cannot run here: no pipeline venv or login-node planner "
                            f"({exc}); {fix} (or pass --no-preflight to queue without the checks); nothing was "
                            "submitted") from None
        print(f"warning: preflight skipped (--no-preflight): the pipeline environment is not available here "
              f"({exc}); the job checks its config when it starts", file=sys.stderr)
        return None
    plan, cfg = launch.preflight, launch.cfg
    if not plan.ok:
        raise UserError("\n".join(plan.problems)
                        + f"\npreflight: {len(plan.problems)} problem(s); nothing was submitted")
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"Preflight: PASS - world {plan.world} (tp {plan.tp} pp {plan.pp} cp {plan.cp} ep {plan.ep} dp {plan.dp}), "
          f"memory estimate {plan.memory_gb.get('total', 0):.1f} of {plan.memory_budget_gb:g} GB", file=sys.stderr)
    name = (cfg.get("logger") or {}).get("wandb_exp_name")
    return str(name) if name else None


def run_job_name(run_name: str | None, config: str) -> str:
    """The Slurm job name of a training run: ``training-<run>``. The auto-requeue chain's singleton key is the
    job name, so two runs' chains never block each other."""
    import re

    base = run_name or Path(config).stem
    return "training-" + (re.sub(r"[^A-Za-z0-9._-]", "_", base)[:100] or "run")


def _script_directive(script: str | None, *names: str) -> str | None:
    """The value of an ``#SBATCH`` option in the batch script's header (first one found), if any."""
    import re

    if script is None or not Path(script).is_file():
        return None
    try:
        lines = Path(script).read_text(errors="replace").splitlines()[:100]
    except OSError:
        return None
    for line in lines:
        for n in names:  # "--output=X", "--output X", "-o X", "-oX"
            hit = re.match(rf"#SBATCH\s+{re.escape(n)}(?:=|\s+|(?<=-[A-Za-z]))(\S+)", line)
            if hit:
                return hit.group(1)
    return None


def log_path(opts: list[str], script: str | None, job_id: str, job_name: str | None) -> Path | None:
    """Where the job's output goes: the user's --output, else the script's ``#SBATCH --output``, else sbatch's
    default; relative to --chdir when given; %j %A %x %u %% substituted (%a stays: one file per array task)."""
    import getpass

    pattern = option_value(opts, "--output", "-o") or _script_directive(script, "--output", "-o") or "slurm-%j.out"
    name = job_name or option_value(opts, "--job-name", "-J") or _script_directive(script, "--job-name", "-J") \
        or (Path(script).name if script else "wrap")
    out = (pattern.replace("%%", "\0").replace("%j", job_id).replace("%A", job_id).replace("%x", name)
           .replace("%u", getpass.getuser()).replace("\0", "%"))
    base = option_value(opts, "--chdir", "-D")
    return (Path(base) / out if base else Path(out)).resolve()



def _looks_local(path: str) -> bool:
    """A local path (to check now), not a hub id ORG/NAME."""
    return path.startswith(("/", ".", "~")) or Path(path).exists() or path.count("/") != 1


def submit_checks(script: str, args: list[str], inputs_later: bool = False) -> None:
    """Cheap checks of a pipeline submission's arguments before anything is queued (paths exist, the action is
    known, numbers are numbers): a mistake is one line now, not a failed job hours later. Standard library
    only: isambard_sbatch runs on login nodes without the pipeline environment.

    ``inputs_later``: the job waits for another (``--dependency``), whose outputs are this job's inputs; their
    existence is then checked by the job itself, and only the shape of the arguments here."""
    name = Path(script).name
    exists = (lambda p: True) if inputs_later else (lambda p: Path(p).exists())
    if name == "pipeline_env_submit.sbatch":
        if not args or args[0] not in ("setup", "validate"):
            raise UserError(f"{name}: the action must be setup or validate (got {args[0] if args else 'none'!r})")
    elif name == "pipeline_data_submit.sbatch":
        if not args:
            raise UserError(f"{name} needs prepare|tokenize|pack ARGS (or DATASET_ROOT TOKENIZER SEQ [PAD])")
        if args[0] == "prepare":
            ds, seq = flag_value(args, "--dataset"), flag_value(args, "--seq-length")
            if ds is None or seq is None:
                raise UserError(f"{name} prepare needs --dataset and --seq-length")
            if ds != "chatterbot-corpus" and _looks_local(ds) and not Path(ds).exists():
                raise UserError(f"{name} prepare: dataset {ds} does not exist")
            if not seq.isdigit() or not 2 <= int(seq) <= 1_048_576:
                raise UserError(f"{name} prepare: --seq-length {seq!r} must be an integer in [2, 1048576]")
        else:
            rest = args[1:] if args[0] in ("tokenize", "pack") else args
            need = 3  # tokenize: ROOT TOKENIZER OUTPUT_NAME; pack: ROOT TOKENIZER SEQ [PAD]
            if len(rest) < need:
                raise UserError(f"{name}: {args[0] if args[0] in ('tokenize', 'pack') else 'pack'} needs DATASET_ROOT "
                                f"TOKENIZER {'OUTPUT_NAME' if args[0] == 'tokenize' else 'SEQ_LENGTH [PAD]'} "
                                f"(the actions are prepare, tokenize, pack)")
            if not exists(rest[0]):
                raise UserError(f"{name}: dataset root {rest[0]} does not exist (the actions are prepare, tokenize, "
                                "pack; or DATASET_ROOT TOKENIZER SEQ [PAD] to pack)")
            if args[0] != "tokenize" and not rest[2].isdigit():
                raise UserError(f"{name}: the sequence length {rest[2]!r} must be an integer")
    elif name == "pipeline_checkpoint_submit.sbatch":
        if not args or args[0] not in ("export", "import", "upload-all"):
            raise UserError(f"{name}: the action must be export, import or upload-all")
        if args[0] == "import" and (len(args) < 2 or args[1].startswith("-")):
            raise UserError(f"{name} import needs HF_ID (a registry name or ORG/NAME) as its first argument")
        for flag in ("--iteration", "--tp", "--pp", "--ep"):
            v = flag_value(args, flag)
            if v is not None and (not v.isdigit() or (flag != "--iteration" and int(v) < 1)):
                kind = "non-negative" if flag == "--iteration" else "positive"
                raise UserError(f"{name}: {flag} {v!r} must be a {kind} integer")
        if args[0] in ("export", "upload-all"):
            if len(args) < 2 or not (exists(args[1]) and (inputs_later or Path(args[1]).is_dir())):
                raise UserError(f"{name} {args[0]}: checkpoint directory {args[1] if len(args) > 1 else '(none)'} "
                                "does not exist")
            if flag_value(args, "--hf-model") is None or not ({"--reasoning", "--no-reasoning"} & set(args)):
                raise UserError(f"{name} {args[0]} needs --hf-model ID and --reasoning or --no-reasoning")
            it = flag_value(args, "--iteration")
            if args[0] == "export" and not inputs_later:
                from pipeline.checkpoint import layout

                layout.resolve_iteration(Path(args[1]), int(it) if it and it.isdigit() else None)
    elif name == "pipeline_coherence_submit.sbatch":
        if not args:
            raise UserError(f"{name} needs MODEL [options]")
        model, backend = args[0], flag_value(args, "--backend") or "hf"
        disc = flag_value(args, "--discovery-file")
        if backend not in ("hf", "endpoint", "megatron"):
            raise UserError(f"{name}: --backend must be hf, endpoint or megatron (got {backend!r})")
        if backend == "endpoint" and disc is None and flag_value(args, "--endpoint-url") is None:
            raise UserError(f"{name}: the endpoint backend needs --endpoint-url URL or --discovery-file FILE")
        if backend == "megatron" and flag_value(args, "--hf-model") is None:
            raise UserError(f"{name}: the megatron backend needs --hf-model ID")
        if backend == "endpoint" and disc is not None and not inputs_later and not Path(disc).is_file():
            raise UserError(f"{name}: discovery file {disc} does not exist (is the serving job running?)")
        if backend in ("hf", "megatron") and _looks_local(model) and not exists(model):
            raise UserError(f"{name}: model {model} does not exist (a local directory, or a hub id ORG/NAME)")


def cluster_nodes() -> set[str] | None:
    """Node names Slurm knows (sbatch rejects an --exclude naming an unknown node), or None if unknown."""
    import subprocess

    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return set(out.stdout.split())


def render_exclude(nodes: list[str], spill_dir: Path = Path("logs/slurm")) -> str:
    """The --exclude value: a compressed hostlist (nid[001-004,010]); if even that is too long for one
    argument, a file holding it (sbatch treats a value containing "/" as a file of node names)."""
    expr = compress(nodes)
    if len(expr) <= MAX_EXCLUDE_ARG:
        return expr
    from pipeline.common.io import write_text

    path = write_text(spill_dir.resolve() / f"exclude.{os.getpid()}.hostlist", expr + "\n")
    print(f"warning: {len(nodes)} excluded nodes do not fit one argument; passing them as file {path}",
          file=sys.stderr)
    return str(path)


def submission_profile(script: str | None, script_args: list[str]):
    """The cluster profile of a submission, in the training launcher's order: a training job's ``--cluster
    NAME``, else PIPELINE_CLUSTER (which pipeline_env_config.env's knobs came from), else a training config's
    ``pipeline.cluster`` (read without YAML: a login node may have no venv), else local_cpu."""
    import re

    from pipeline.config.cluster import DEFAULT_PROFILE, load_cluster

    name = None
    for i, a in enumerate(script_args):
        if a == "--cluster" and i + 1 < len(script_args):
            name = script_args[i + 1]
        elif a.startswith("--cluster="):
            name = a.split("=", 1)[1]
    name = name or os.environ.get("PIPELINE_CLUSTER")
    if not name and script is not None and Path(script).name == TRAINING_SCRIPT and script_args:
        try:
            text = Path(script_args[0]).read_text(errors="replace")
        except OSError:
            text = ""
        m = re.search(r"^pipeline:[ \t]*(?:#.*)?\n(?:[ \t]+.*\n|[ \t]*#.*\n|[ \t]*\n)*?[ \t]+cluster:[ \t]*"
                      r"[\"']?([A-Za-z0-9_.-]+)", text, re.M)
        name = m.group(1) if m and m.group(1) != "null" else None
    return load_cluster(name or DEFAULT_PROFILE)


GPU_JOB_SCRIPTS = {"pipeline_checkpoint_submit.sbatch": "pipeline.cli.checkpoint",
                   "pipeline_coherence_submit.sbatch": "pipeline.cli.coherence"}


def gpu_job_plan(script: str, script_args: list[str], opts: list[str], required: bool = True,
                 inputs_later: bool = False) -> None:
    """The plan of a checkpoint or coherence submission (checkpoint/plan.py, coherence/plan.py), made here as the
    job would make it: a layout that cannot run, a node count the job cannot use or a model that does not fit is
    refused (UserError, one line per problem) before the queue wait. Needs the pipeline venv or the login node's
    planner, as the training preflight does."""
    import importlib

    nodes = option_value(opts, "--nodes", "-N") or option_value(split_sbatch_args(script_directives(script))[0],
                                                                "--nodes", "-N") or "1"
    nodes = nodes.split("-")[0]
    if not nodes.isdigit():
        raise UserError(f"--nodes={nodes!r} is not a node count")
    try:
        cli = importlib.import_module(GPU_JOB_SCRIPTS[Path(script).name])
    except ImportError as exc:
        if required:
            raise UserError(f"the {Path(script).name} plan cannot be checked here: no pipeline venv or login-node "
                            f"planner ({exc}); create the planner with: {PLANNER_SETUP} (or pass --no-preflight to "
                            "queue without the checks); nothing was submitted") from None
        print(f"warning: plan check skipped (--no-preflight): {exc}", file=sys.stderr)
        return
    plan = cli.plan_from_argv(list(script_args), int(nodes), inputs_later=inputs_later)
    asked = option_value(opts, "--gpus-per-node")
    asked = asked.split(":")[-1] if asked else None  # --gpus-per-node=[type:]N
    if asked is not None and asked.isdigit() and int(asked) < plan.gpus_per_node:
        plan.problems.append(f"the {plan.job} plan ({plan.engine}) uses {plan.gpus_per_node} GPU(s) per node, and "
                             f"--gpus-per-node={asked} gives {asked}: submit with --gpus-per-node={plan.gpus_per_node}"
                             f" (the plan: {plan.job} ... --dry-run)")
    if not plan.ok:
        raise UserError("\n".join(plan.problems) + f"\nplan: {len(plan.problems)} problem(s); nothing was submitted")
    print(f"Plan: PASS - {plan.job}: world {plan.world_size} on {plan.nodes} node(s) (tp {plan.layout.tp} pp "
          f"{plan.layout.pp} ep {plan.layout.ep}), memory estimate {plan.memory_per_gpu_gb:.1f} GB per GPU",
          file=sys.stderr)


def build_submission(argv: list[str]) -> tuple[list[str], list[str], Path]:
    """The sbatch command line (a list, never a shell string), the excluded nodes, and the log path."""
    log = from_env()
    opts, user_ex, script, script_args = split_sbatch_args(argv)
    no_preflight = "--no-preflight" in opts
    opts = [o for o in opts if o not in OWN_FLAGS]
    if script is None and option_value(opts, "--wrap") is None:
        raise UserError("no batch script given (usage: isambard_sbatch [sbatch options] SCRIPT [args])")
    # sbatch lets a command-line --exclude replace the script's own #SBATCH --exclude: merge the header's in, or a
    # bad-node exclusion would silently drop the nodes the script itself excludes.
    try:
        header_ex = split_sbatch_args(script_directives(script))[1] if script is not None else []
    except UserError:
        header_ex = []  # a header sbatch itself would refuse: sbatch says so when it reads it
    user_nodes: list[str] = []
    for ex in user_ex + header_ex:
        if not is_hostlist(ex):
            raise UserError(f"invalid --exclude value {ex!r}: expected node names or a hostlist like nid[001-004]")
        user_nodes += expand(ex)
    bad = [e.node for e in log.active()]
    known = cluster_nodes()
    if known is not None:
        unknown = sorted(set(bad) - known)
        if unknown:
            print(f"warning: {len(unknown)} logged node(s) are not in this cluster and are not excluded: "
                  f"{', '.join(unknown[:5])}", file=sys.stderr)
        bad = [n for n in bad if n in known]
    excluded = sorted(set(user_nodes) | set(bad))
    cmd = ["sbatch", *opts, *profile_sbatch_options(submission_profile(script, script_args), opts,
                                                     script_directives(script))]
    if excluded:
        cmd.append("--exclude=" + render_exclude(excluded))
    if script is not None:
        cmd += [script, *script_args]
    if script is not None:
        later = option_value(opts, "--dependency", "-d") is not None
        submit_checks(script, script_args, inputs_later=later)
    if script is not None and Path(script).name in GPU_JOB_SCRIPTS:
        gpu_job_plan(script, script_args, opts, required=not no_preflight,
                     inputs_later=option_value(opts, "--dependency", "-d") is not None)
    if script is not None and Path(script).name == TRAINING_SCRIPT:
        name = training_preflight(script_args, opts, required=not no_preflight)
        if option_value(opts, "--job-name", "-J") is None:
            cmd.insert(1, f"--job-name={run_job_name(name, script_args[0])}")
    return cmd, bad, log.path


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    log = from_env()
    if argv[0] in CRUD:
        action, rest = argv[0], argv[1:]
        if action == "--mark-bad":
            if not rest:
                raise UserError("--mark-bad needs a node name")
            names = log.mark(rest[0], " ".join(rest[1:]))
            print(f"marked bad: {', '.join(names)} (excluded for {log.ttl_days:g} days) - file: {log.path}")
        elif action == "--list-bad":
            import datetime as dt

            now = dt.datetime.now(dt.UTC)
            entries = log.entries()
            print(f"# {log.path} (TTL {log.ttl_days:g} days; * = excluded now, ! = dated in the future)")
            for e in entries:
                star = "!" if is_future(e, now) else "*" if log.is_active(e, now) else " "
                print(f"{star} {e.node:<16} {e.time:%Y-%m-%d %H:%M}Z  {printable(e.user):<10} "
                      f"{printable(e.host):<12} {printable(e.reason)}")
            print(f"{len(log.active())} node(s) excluded, {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
        elif action == "--update-bad":
            if len(rest) < 2:
                raise UserError("--update-bad needs NODE REASON")
            n = log.update(rest[0], " ".join(rest[1:]))
            print(f"updated {n} entr{'y' if n == 1 else 'ies'} for {rest[0]}")
        elif action == "--unmark-bad":
            if len(rest) != 1:
                raise UserError("--unmark-bad needs exactly one NODE")
            n = log.unmark(rest[0])
            print(f"removed {n} entr{'y' if n == 1 else 'ies'} for {rest[0]}")
        else:
            n = log.prune()
            print(f"pruned {n} entr{'y' if n == 1 else 'ies'} older than {log.ttl_days:g} days from {log.path}")
        return 0

    cmd, bad, path = build_submission(argv)
    Path("logs/slurm").mkdir(parents=True, exist_ok=True)
    print(f"Bad nodes: {len(bad)} excluded (last {log.ttl_days:g}d) - file: {path}", file=sys.stderr)
    print("           report more: isambard_sbatch --mark-bad <node> [reason]", file=sys.stderr)
    if shutil.which("sbatch") is None:
        raise UserError("sbatch not found on PATH (is this a Slurm login node?)")
    sys.stdout.flush()
    import subprocess

    res = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.returncode != 0:
        return res.returncode
    import re

    m = re.search(r"(\d+)", res.stdout)
    if m:
        opts, _, script, _ = split_sbatch_args(cmd[1:])
        out = log_path(opts, script, m.group(1), option_value(opts, "--job-name", "-J"))
        print(f"job {m.group(1)}: log {out}" if out else f"job {m.group(1)} submitted", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
