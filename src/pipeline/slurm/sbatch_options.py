"""The sbatch option grammar: which options take a value (the installed sbatch's --help/--usage, else a built-in
table), an sbatch command line split the way sbatch's getopt reads it, and a batch script's ``#SBATCH`` header.
Standard library only: isambard_sbatch runs on login nodes without the pipeline environment."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
from pathlib import Path

from pipeline.common.argv import flag_values, has_flag
from pipeline.common.errors import UserError
from pipeline.config.cluster import ClusterProfile

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
    texts = []
    for flag in ("--help", "--usage"):
        try:
            res = subprocess.run(["sbatch", flag], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        texts.append(res.stdout)
    if not any(texts):
        return None
    values, flags = set(UNLISTED_VALUE_OPTS), set[str]()
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


def split_sbatch_args(argv: list[str], table: tuple[frozenset[str], frozenset[str]] | None = None,
                      own_flags: tuple[str, ...] = ()) -> tuple[list[str], list[str], str | None, list[str]]:
    """(sbatch options without excludes, user excludes, script, script args), parsed the way sbatch's getopt
    does: which options take a value comes from the installed sbatch (``sbatch_option_table``); clustered short
    options (``-HN 2``), unique abbreviations of long options (``--job`` for ``--job-name``) and ``--`` work;
    an option sbatch does not know is refused with one line. The options come back normalised (``--long=value``,
    ``-S value``, flags alone), which sbatch reads the same way. ``own_flags``: the caller's own options among
    sbatch's (isambard_sbatch's --no-preflight), kept in the options exactly as written."""
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
        if a in own_flags:  # the caller's own, exactly as written (the caller takes them out)
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
    """The value of an option in normalised ``opts`` (as split_sbatch_args returns them), the *last* one among
    ``names`` as sbatch reads a repeated option (``--nodes=1 --nodes=2`` allocates 2; ``-N 1 --nodes=2`` too);
    values of other options are never mistaken for options."""
    values, _, _ = _table()
    found = None
    i = 0
    while i < len(opts):
        a = opts[i]
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if name in names and eq:
                found = val
            i += 1
            continue
        if a in values:
            if a in names and i + 1 < len(opts):
                found = opts[i + 1]
            i += 2
            continue
        i += 1
    return found


def submitted_value(opts: list[str], script: str | None, *names: str, env: str | None = None) -> str | None:
    """An option's value as the job gets it: the command line's (last one) over the input environment variable
    sbatch reads for it (``env``, e.g. SBATCH_TIMELIMIT: it overrides the script) over the script's #SBATCH header's."""
    value = option_value(opts, *names)
    if value is None and env is not None:
        value = os.environ.get(env) or None
    return value if value is not None else directive_value(script, *names)


def time_limit_seconds(value: str) -> int | None:
    """Slurm's --time in seconds (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``); None for a value
    it does not read that way (``infinite``, ``UNLIMITED``, or one sbatch itself will refuse)."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if not m:
        return None
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    assert a is not None  # the pattern's one required group
    if days is not None:  # D-H[:M[:S]]
        return ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return (a * 60 + (b or 0)) * 60 + c
    return a * 60 + (b or 0)  # M or M:S


def signal_lead_seconds(value: str) -> int | None:
    """The seconds before the limit at which ``--signal=[{R|B}:]SIG[@TIME]`` fires (Slurm's default 60)."""
    m = re.fullmatch(r"(?:[RB]{1,2}:)?[A-Za-z0-9]+(?:@(\d+))?", value.strip())
    if not m:
        return None
    return int(m.group(1)) if m.group(1) is not None else 60


def node_count(opts: list[str], script: str | None = None) -> int:
    """The node count sbatch allocates (``--nodes``/``-N``, command line over header, last wins; 1 when unset). A
    range (``2-4``) lets Slurm pick the count when the job starts, after every plan was made for one count: refused
    unless both ends agree; anything else that is not a positive count is refused."""
    raw = submitted_value(opts, script, "--nodes", "-N")
    if raw is None:
        return 1
    m = re.fullmatch(r"([0-9]{1,6})(?:-([0-9]{1,6}))?", raw.strip())
    if not m or int(m.group(1)) < 1:
        raise UserError(f"--nodes={raw!r} is not a node count (a positive integer)")
    if m.group(2) is not None and int(m.group(2)) != int(m.group(1)):
        raise UserError(f"--nodes={raw}: a range lets Slurm choose the node count when the job starts, and the job is "
                        f"planned for one count; give it: --nodes={m.group(1)} (or --nodes={m.group(2)})")
    return int(m.group(1))


GPU_OPTIONS = ("--gpus-per-node", "--gpus", "-G", "--gres", "--gpus-per-task", "--gpus-per-socket", "--tres-per-task")


def _gres_gpus(gres: str) -> int | None:
    """GPUs per node a ``--gres`` value asks for (``gpu:4``, ``gpu:a100:4``, ``gpu`` = 1, ``gres/gpu:2``, among other
    resources ``gpu:4,nvme:1``); None when it names no GPU; UserError for a count that is not one."""
    total = None
    for entry in gres.split(","):
        parts = entry.strip().split(":")
        if parts[0].removeprefix("gres/") != "gpu":
            continue
        count = parts[-1] if len(parts) > 1 and not (len(parts) == 2 and not parts[1].isdigit()) else "1"
        if not count.isdigit():
            raise UserError(f"--gres={gres!r}: the GPU count {count!r} is not a number")
        total = (total or 0) + int(count)
    return total


def _count(option: str, value: str) -> int:
    count = value.split(":")[-1]  # [type:]N
    if not count.isdigit():
        raise UserError(f"{option}={value!r} is not a GPU count ([type:]N)")
    return int(count)


def gpus_per_node_asked(opts: list[str], script: str | None, nodes: int) -> tuple[int, str] | None:
    """(GPUs per node, the option as written) that the submission's GPU options ask for, command line over header;
    None when none is given (the cluster profile's --gpus-per-node is then added). Every form sbatch takes is read:
    ``--gpus-per-node=[type:]N``, ``--gres=gpu[:type]:N``, ``--gpus/-G [type:]N`` (a job total: exact on one node;
    over several nodes Slurm may place it unevenly, so it is refused there); forms that do not say GPUs per node
    (``--gpus-per-task``, ``--gpus-per-socket``, ``--tres-per-task``), ``--tres-per-node=gres/gpu:N`` and two forms
    at once are refused."""
    given = {}
    for names in (("--gpus-per-node",), ("--gpus", "-G"), ("--gres",), ("--gpus-per-task",), ("--gpus-per-socket",),
                  ("--tres-per-task",), ("--tres-per-node",)):
        value = submitted_value(opts, script, *names)
        if value is None:
            continue
        if names == ("--gres",) and _gres_gpus(value) is None:
            continue  # a --gres of other resources asks for no GPU
        if names in (("--tres-per-task",), ("--tres-per-node",)) and "gpu" not in value:
            continue
        given[names[0]] = value
    if not given:
        return None
    if len(given) > 1:
        both = " and ".join(f"{k}={v}" for k, v in given.items())
        raise UserError(f"{both}: GPUs asked for in two ways; give one, --gpus-per-node=N (the plan counts GPUs per "
                        "node)")
    option, value = next(iter(given.items()))
    if option == "--gpus-per-node":
        return _count(option, value), f"{option}={value}"
    if option == "--gres":
        return _gres_gpus(value) or 0, f"{option}={value}"
    if option == "--gpus":
        total = _count(option, value)
        if nodes == 1:
            return total, f"{option}={value}"
        raise UserError(f"--gpus={value} is a total over the job's {nodes} nodes, which Slurm may place unevenly; "
                        f"the plan counts GPUs per node: use --gpus-per-node=N")
    if option == "--tres-per-node":  # else passed through unread, beside the profile's --gpus-per-node
        raise UserError(f"{option}={value}: the plan does not read GPUs asked for as a trackable resource; use "
                        "--gpus-per-node=N")
    raise UserError(f"{option}={value}: GPUs per task or socket do not say how many GPUs each node gets, and the plan "
                    "counts GPUs per node: use --gpus-per-node=N")


def script_directives(script: str | None) -> list[str]:
    """The options of a batch script's #SBATCH header (sbatch reads them up to the first command)."""
    if script is None or not Path(script).is_file():
        return []
    out: list[str] = []
    try:
        for line in Path(script).read_text(errors="replace").splitlines()[1:]:
            if line.startswith("#SBATCH"):
                try:
                    out += shlex.split(line[len("#SBATCH"):], comments=True)
                except ValueError:
                    continue
            elif line.strip() and not line.startswith("#"):
                break
    except OSError:
        return []
    return out


def header_options(script: str | None) -> tuple[list[str], list[str]]:
    """(options without excludes, excludes) of a batch script's #SBATCH header, normalised as
    :func:`split_sbatch_args` returns them; UserError for a header sbatch itself would refuse."""
    opts, excludes, _, _ = split_sbatch_args(script_directives(script))
    return opts, excludes


def directive_value(script: str | None, *names: str) -> str | None:
    """The value of an option in a batch script's #SBATCH header (the last one, as sbatch reads it), or None (also
    for a header that sbatch would refuse: sbatch says so itself)."""
    try:
        return option_value(header_options(script)[0], *names)
    except UserError:
        return None


def check_signal_lead(script: str, opts: list[str]) -> None:
    """A training's time limit must outlast the pre-limit save signal (the batch script's ``--signal=B:USR1@S``):
    at or under its lead the signal fires at once, the engine saves at step 1 and the job requeues itself, over and
    over, each attempt reporting a PASS."""
    # as sbatch reads them: the command line, then its input environment (SBATCH_TIMELIMIT, SBATCH_SIGNAL), then
    # the script's header; --time-min lets Slurm lower the limit to it, so the shortest limit the job may get counts
    # (neither may bypass the check), and a limit of 0 is Slurm's "no limit", not 0 s.
    signal = submitted_value(opts, script, "--signal", env="SBATCH_SIGNAL")
    lead = signal_lead_seconds(signal) if signal else None
    if lead is None:
        return
    for names, env, why in ((("--time", "-t"), "SBATCH_TIMELIMIT", ""),
                            (("--time-min",), None, ", the limit Slurm may lower the job's to")):
        limit = submitted_value(opts, script, *names, env=env)
        seconds = time_limit_seconds(limit) if limit else None
        if seconds is not None and 0 < seconds <= lead:
            raise UserError(f"{names[0]}={limit} ({seconds} s{why}) is at or under the pre-limit save signal's lead "
                            f"(--signal={signal}: {lead} s before the limit): the job would save and requeue at once; "
                            f"ask for more than {lead // 60} minutes, or a shorter lead (--signal=B:USR1@S)")


def profile_sbatch_options(profile: ClusterProfile, user_opts: list[str], script_opts: list[str] | tuple[str, ...] = ()
                           ) -> list[str]:
    """The sbatch options the cluster profile adds to a submission (pure; sorted): --gpus-per-node (when > 0),
    --partition, --account, --time, --exclusive - each only when neither the user's command line nor the
    script's own #SBATCH header sets it (user > script header > profile). The values were validated by
    ClusterProfile, and the result is an argv list, never shell text."""
    given = [*user_opts, *script_opts]
    out = []
    asks_gpus = has_flag(given, "--gpus-per-node", "--gpus", "-G", "--gpus-per-task", "--gpus-per-socket") or any(
        "gpu" in v for v in (*flag_values(given, "--gres"), *flag_values(given, "--tres-per-task")))
    if profile.gpus_per_node > 0 and not asks_gpus:  # a --gres of other resources asks for no GPU
        out.append(f"--gpus-per-node={profile.gpus_per_node}")
    if profile.partition and not has_flag(given, "--partition", "-p"):
        out.append(f"--partition={profile.partition}")
    if profile.account and not has_flag(given, "--account", "-A"):
        out.append(f"--account={profile.account}")
    if profile.time_limit and not has_flag(given, "--time", "-t"):
        out.append(f"--time={profile.time_limit}")
    if profile.exclusive and not has_flag(given, "--exclusive", "--oversubscribe", "-s"):
        out.append("--exclusive")
    return sorted(out)
