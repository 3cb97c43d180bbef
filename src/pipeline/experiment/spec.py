"""The experiment file (YAML) and its expansion into named runs (pure: no Slurm, no training config loading).

    name: lr_gbs                      # optional; default: the file's stem ([A-Za-z0-9._-])
    base:
      config: configs/local/tiny_moe_sft.yaml   # relative paths are relative to the repository root
      model: tiny-qwen3-moe
      mode: sft
      nodes: 1                        # default 1
      cluster: local_cpu              # optional launcher --cluster
      flags: [--disable-ft]           # launcher flags
      sbatch: [--time=30]             # extra sbatch options for every job
      overrides:                      # Hydra overrides shared by every run (dotted key: value)
        train.train_iters: 8
    grid:                             # the product of the axes
      optimizer.lr: [3.0e-3, 1.0e-3]  # an override axis: one run per value
      size:                           # a named axis: a label per value, each a set of overrides
        small: {train.global_batch_size: 2}
        big: {train.global_batch_size: 4}
    zip:                              # lists of equal length taken together: one more axis
      optimizer.min_lr: [3.0e-4, 1.0e-4]
      scheduler.lr_warmup_iters: [1, 2]
    computed:                         # OmegaConf interpolation over the run's values and the base config
      optimizer.min_lr: ${calc:'${optimizer.lr} / 10'}
    phases:                           # optional; default: one training phase
      - {name: pretrain, overrides: {...}, upload_all: true}
      - {name: cooldown, from: pretrain, iteration: last, tokens: 4096,   # init: continue (the default)
         overrides: {scheduler.lr_decay_style: WSD, scheduler.lr_wsd_decay_style: linear}}
      - {name: export, kind: export, args: [--atol, "1e-2"]}
      - {name: coherence, kind: coherence, args: [--max-tokens, "8"]}

A training phase from a training phase continues it by default (``init: continue``, a WSD cooldown: the
optimizer state, LR scheduler and iteration count of the named iteration, ``train.train_iters`` and ``tokens``
counting on from it, checkpoints in the phase's own save) or starts from its weights only (``init: weights``:
a fresh optimizer, iterations from 1).

A run's label is built from the values of its axes (``lr0.003_small``), its name is ``<experiment>.<label>``
and each training phase trains in its own run directory named ``<experiment>.<label>[.<phase>]`` (the phase
is part of the name whenever the file has ``phases``), which is also its ``logger.wandb_exp_name``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.common import mappings, yamlio
from pipeline.common.errors import UserError
from pipeline.config.kinds import PHASE_KINDS, PhaseKind, is_phase_kind

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
TOP_KEYS = {"name", "description", "base", "grid", "zip", "computed", "phases"}
BASE_KEYS = {"config", "model", "mode", "nodes", "cluster", "flags", "sbatch", "overrides"}
PHASE_KEYS = {"name", "kind", "from", "iteration", "init", "tokens", "overrides", "args", "sbatch", "upload_all"}
INITS = ("continue", "weights")  # a training phase from a training phase: go on with its run, or its weights only
# Short names of common override keys in run labels (the last dotted component otherwise).
ABBREV = {"global_batch_size": "gbs", "micro_batch_size": "mbs", "train_iters": "iters", "seq_length": "seq",
          "lr_warmup_iters": "warmup", "weight_decay": "wd", "min_lr": "minlr", "lr_decay_style": "decay",
          "lr_decay_iters": "decayiters", "save_interval": "save", "adam_beta2": "beta2", "adam_beta1": "beta1",
          "clip_grad": "clip", "seed": "seed"}
RESERVED = ("logger.wandb_exp_name",)  # the experiment names every run itself


@dataclass(frozen=True)
class Base:
    config: str
    model: str
    mode: str
    nodes: int = 1
    cluster: str | None = None
    flags: tuple[str, ...] = ()
    sbatch: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Phase:
    name: str
    kind: PhaseKind = "train"
    start: str | None = None            # ``from``: the phase whose outputs this one starts from
    iteration: int | str | None = None  # train phase from a train phase: "last" or a saved iteration
    init: str | None = None             # train phase from a train phase: "continue" (default) or "weights"
    tokens: int | None = None           # train phase: token budget (sets train.train_iters)
    overrides: dict[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()          # export / coherence: extra arguments of the pipeline
    sbatch: tuple[str, ...] = ()
    upload_all: tuple[str, ...] | None = None  # train phase: upload-all --poll rides along (its extra arguments)


@dataclass(frozen=True)
class Run:
    label: str
    values: dict[str, Any]     # what differs between the runs (axis key -> value)
    overrides: dict[str, Any]  # every override of the run: base < axes < computed
    nodes: int | None = None   # a swept node count (the axis key ``nodes``); None: base.nodes
    # each training phase's own overrides for this run, ${...} resolved (${exp.name}, ${exp.label}, ${exp.phase},
    # the run's values, the base config); a phase not here has none
    phase_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    def node_count(self, base: Base) -> int:
        return self.nodes if self.nodes is not None else base.nodes


@dataclass(frozen=True)
class Experiment:
    name: str
    path: Path
    base: Base
    phases: tuple[Phase, ...]
    runs: tuple[Run, ...]
    explicit_phases: bool
    description: str = ""

    def run_name(self, run: Run, phase: Phase | None = None) -> str:
        """The run directory / W&B name of a training phase (``<experiment>.<label>[.<phase>]``)."""
        name = f"{self.name}.{run.label}"
        return f"{name}.{phase.name}" if phase is not None and self.explicit_phases else name

    def select(self, only: list[str] | None) -> list[Run]:
        if not only:
            return list(self.runs)
        picked = []
        for want in only:
            hits = [r for r in self.runs if want in (r.label, f"{self.name}.{r.label}")]
            if not hits:
                names = ", ".join(r.label for r in self.runs[:12])
                raise UserError(f"--only {want!r}: no such run in {self.path} (runs: {names}"
                                f"{', ...' if len(self.runs) > 12 else ''})")
            picked += [r for r in hits if r not in picked]
        return picked

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


# ---- computed values: OmegaConf interpolation with a small arithmetic resolver ----------------------------------
_Fn = Callable[..., Any]
_OPS: dict[type[ast.operator | ast.unaryop], _Fn] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
    ast.UAdd: operator.pos}
_FUNCS: dict[str, _Fn] = {"min": min, "max": max, "int": int, "float": float, "round": round, "abs": abs,
                          "ceil": math.ceil, "floor": math.floor}


CALC_INT_LIMIT = 2**63  # a config value; a bigger integer is a typo (9**9**9 hung the planner for good)


def _bounded(value):
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= CALC_INT_LIMIT:
        raise ValueError(f"an integer of {value.bit_length()} bits is out of range (|x| < 2**63)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not a finite number")
    return value


def _power(base, exp):
    """``**`` refused before it runs when an integer result would leave the range (it would never finish)."""
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1 \
            and exp * math.log2(abs(base)) >= 63:
        raise ValueError(f"{base}**{exp} is out of range (|x| < 2**63)")
    return operator.pow(base, exp)


def calc(expr: str) -> int | float:
    """Evaluate arithmetic on numbers (``+ - * / // % **``, min, max, int, float, round, abs, ceil, floor); every
    integer stays below 2**63 and every float finite, checked as it is computed."""
    def ev(node):
        return _bounded(ev_(node))

    def ev_(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            op = _power if isinstance(node.op, ast.Pow) else _OPS[type(node.op)]
            return op(ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS \
                and not node.keywords:
            return _FUNCS[node.func.id](*(ev(a) for a in node.args))
        raise ValueError(f"not allowed in calc: {ast.unparse(node)!r}")

    try:
        value = ev(ast.parse(str(expr).strip(), mode="eval"))
        return float(f"{value:.12g}") if isinstance(value, float) else value  # 0.0003, not 0.00030000000000000003
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as exc:
        raise ValueError(f"calc:{expr!r}: {exc}") from None


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("calc"):
        OmegaConf.register_new_resolver("calc", calc)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    try:
        return mappings.nest(flat)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def resolve_values(values: dict[str, Any], context: dict[str, Any], what: str = "computed value") -> dict[str, Any]:
    """Resolve every ``${...}`` in ``values`` (dotted key -> value) against ``context`` (the base config, nested)
    merged with the values themselves; values without interpolation are returned as they are."""
    todo = [k for k, v in values.items() if isinstance(v, str) and "${" in v]
    if not todo:
        return dict(values)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register_resolvers()
    try:
        conf = OmegaConf.create(mappings.deep_merge(context, nest(values)))
    except OmegaConfBaseException as exc:  # a malformed ${...}: one line, not a traceback
        key = getattr(exc, "full_key", None) or "?"
        raise UserError(f"{what} {key} does not parse: {str(exc).splitlines()[0]}") from None
    out = dict(values)
    for k in todo:
        try:
            v = OmegaConf.select(conf, k.lstrip("+"), throw_on_missing=True)
        except (OmegaConfBaseException, ValueError) as exc:
            msg = str(exc).splitlines()[0]
            raise UserError(f"{what} {k}={values[k]!r} does not resolve: {msg}") from None
        out[k] = OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
    return out


# ---- names --------------------------------------------------------------------------------------------------
def short_key(key: str) -> str:
    last = key.lstrip("+~").split(".")[-1]
    return ABBREV.get(last, last)


def fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, float):
        s = f"{v:g}"
    elif v is None:
        s = "null"
    elif isinstance(v, (list, tuple)):
        s = "-".join(fmt_value(x) for x in v)
    else:
        s = str(v)
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", s).strip("-") or "x"


def render_override(key: str, value: Any) -> str:
    """``key=value`` in Hydra's override grammar (strings quoted when they need it)."""
    if key.startswith("~"):
        return key
    return f"{key}={_hydra_value(value)}"


def _hydra_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    s = str(v)
    if re.fullmatch(r"[A-Za-z0-9_./:+@-]+", s) and _hydra_reads_as_string(s):
        return s
    # Hydra's quoted string: a quote is escaped, and so is every backslash run before a quote or the closing quote
    body = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, s)
    return "'" + body.replace("'", "\\'") + "'"


@functools.lru_cache(maxsize=4096)
def _hydra_reads_as_string(s: str) -> bool:
    """Whether Hydra's grammar reads ``key=<s>`` as the string ``s``: ``1e3`` is the float 1000.0, ``1_000`` the int
    1000, ``inf``/``nan``/``-0``/``true``/``null`` are not strings either, so those are quoted."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        ov = OverridesParser.create().parse_override(f"k={s}")
    except HydraException:
        return False
    value = ov.value()
    return isinstance(value, str) and value == s


# ---- loading ------------------------------------------------------------------------------------------------
def _mapping(x: Any, where: str) -> dict:
    if x is None:
        return {}
    if not isinstance(x, dict):
        raise UserError(f"{where} must be a mapping (got {type(x).__name__})")
    return x


def _strs(x: Any, where: str) -> tuple[str, ...]:
    if x is None:
        return ()
    if isinstance(x, str):
        return (x,)
    if not isinstance(x, list) or not all(isinstance(a, (str, int, float)) for a in x):
        raise UserError(f"{where} must be a list of strings")
    return tuple(str(a) for a in x)


# sbatch options an experiment's sbatch lists may not hold: the experiment sets them itself, or every job would run
# into one run directory (isambard_sbatch refuses --array and --chdir for the pipeline's jobs at submit time, after
# earlier runs were queued). base.sbatch: [--nodes=2] had been planned for base.nodes (1) and allocated 2.
SBATCH_REFUSED = {"--nodes": "the runs are planned for base.nodes: set the node count there",
                  "--dependency": "the experiment chains its phases itself (from:)",
                  "--array": "every array task would train into the same run directory: sweep with grid or zip",
                  "--chdir": "the jobs run from the checkout the experiment is planned in"}
SBATCH_SHORT = {"-N": "--nodes", "-d": "--dependency", "-a": "--array", "-D": "--chdir"}


def sbatch_options(x: Any, where: str, training: bool = True) -> tuple[str, ...]:
    """An experiment's extra sbatch options, refusing those the planner does not model (SBATCH_REFUSED); an export or
    coherence phase may ask for its own --nodes (a megatron coherence over several nodes)."""
    opts = _strs(x, where)
    for opt in opts:
        name = opt.split("=", 1)[0] if opt.startswith("--") else SBATCH_SHORT.get(opt[:2], opt[:2])
        if name in SBATCH_REFUSED and (training or name != "--nodes"):
            raise UserError(f"{where}: {opt!r}: {name} is not an experiment's sbatch option: {SBATCH_REFUSED[name]}")
    return opts


# The launcher flags an experiment may set, each modelled by the planner (plan.py passes it to the LaunchRequest it
# plans with): True for a flag that takes a value. Any other launcher flag is refused, naming its place in the file.
LAUNCHER_FLAGS = {"--disable-ft": False, "--peft": True, "--cluster": True, "--max-restarts": True}
FLAG_INSTEAD = {
    "--run-dir": "the experiment names each run's directory (from the run's name); rename the experiment or its runs",
    "--nodes": "use base.nodes", "--model": "use base.model", "--mode": "use base.mode",
    "--allow-config-change": "pass it to `submit`", "--dry-run": "use `render`",
    "--no-path-checks": "the planner checks the paths each phase can check when it is planned",
}


def launcher_flags(flags: tuple[str, ...], where: str) -> tuple[str, ...]:
    """``base.flags`` checked: only the flags of :data:`LAUNCHER_FLAGS`, each once, with its value. Before, a flag the
    planner did not model was passed to the job unplanned: ``flags: [--run-dir, X]`` put every run of a sweep in one
    run directory (the second failed; ``status`` showed nothing for the first)."""
    seen: set[str] = set()
    i = 0
    while i < len(flags):
        word = flags[i]
        name, eq, value = word.partition("=")
        if name in FLAG_INSTEAD:
            raise UserError(f"{where}: {name} is not an experiment flag: {FLAG_INSTEAD[name]}")
        if name not in LAUNCHER_FLAGS:
            raise UserError(f"{where}: {word!r} is not a launcher flag the planner models (valid: "
                            f"{', '.join(LAUNCHER_FLAGS)}; Hydra overrides go in base.overrides)")
        if name in seen:
            raise UserError(f"{where}: {name} is given twice")
        seen.add(name)
        if LAUNCHER_FLAGS[name] and not eq:
            if i + 1 >= len(flags) or flags[i + 1].startswith("--"):
                raise UserError(f"{where}: {name} needs a value")
            value, i = flags[i + 1], i + 1
        elif not LAUNCHER_FLAGS[name] and eq:
            raise UserError(f"{where}: {name} takes no value")
        if name == "--peft" and value != "lora":
            raise UserError(f"{where}: --peft {value!r} is not one of: lora")
        if name == "--max-restarts" and not re.fullmatch(r"[0-9]{1,4}", value):
            raise UserError(f"{where}: --max-restarts {value!r} must be an integer from 0 to 9999")
        i += 1
    return flags


def _overrides(x: Any, where: str) -> dict[str, Any]:
    d = _mapping(x, where)
    for k in d:
        if not isinstance(k, str) or not re.fullmatch(r"[+~]?[A-Za-z_][A-Za-z0-9_.]*", k):
            raise UserError(f"{where}: {k!r} is not a dotted config key (like train.train_iters)")
        if k.lstrip("+~") in RESERVED:
            raise UserError(f"{where}: {k} is set by the experiment (each run is named <experiment>.<label>)")
    yamlio.refuse_missing(d, where)
    _refuse_unpassable(d, where)
    return dict(d)


MAX_VALUE_CHARS = 32 * 1024  # one override on a command line; the kernel caps one argument at 128 KiB


def _refuse_unpassable(value: Any, where: str) -> None:
    """A value no command line can carry: a NUL (bash cuts the word there: the job got another value, and submit
    failed with a traceback after its preflight said PASS), or text past MAX_VALUE_CHARS ("Argument list too long"
    after the preflight)."""
    if isinstance(value, dict):
        for v in value.values():
            _refuse_unpassable(v, where)
    elif isinstance(value, list):
        for v in value:
            _refuse_unpassable(v, where)
    elif isinstance(value, str):
        if "\0" in value:
            raise UserError(f"{where}: a value holds a NUL byte, which no command line can pass to the job")
        if len(value) > MAX_VALUE_CHARS:
            raise UserError(f"{where}: a value of {len(value)} characters is longer than a command line passes "
                            f"({MAX_VALUE_CHARS}): put it in the training config instead")


# A sweep larger than this on a shared cluster is a mistake; expanding it would also take minutes.
MAX_RUNS = 1000


def _check_unknown(d: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise UserError(f"{where}: unknown key(s) {', '.join(map(str, extra))} (valid: {', '.join(sorted(allowed))})")


def load(path: str | Path, root: Path | None = None) -> Experiment:
    """Read and expand an experiment file; every mistake is one UserError line."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"experiment file {path} does not exist")
    if not path.is_file():
        raise UserError(f"experiment file {path} is not a file")
    try:
        raw = yamlio.load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"{path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    except UnicodeDecodeError:  # one line, not a traceback
        raise UserError(f"{path}: not a text file (invalid UTF-8); expected a YAML experiment file") from None
    except ValueError as exc:  # an integer past Python's 4300-digit conversion limit
        raise UserError(f"{path}: a value cannot be read: {str(exc)[:120]}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror})") from None
    raw = _mapping(raw, str(path))
    _check_unknown(raw, TOP_KEYS, str(path))
    name = str(raw.get("name") or path.stem)
    if not NAME_RE.match(name):
        raise UserError(f"{path}: experiment name {name!r} must match [A-Za-z0-9][A-Za-z0-9._-]* (at most 80)")
    b = _mapping(raw.get("base"), f"{path}: base")
    _check_unknown(b, BASE_KEYS, f"{path}: base")
    for need in ("config", "model", "mode"):
        if not b.get(need):
            raise UserError(f"{path}: base.{need} is required (base: config, model, mode)")
    nodes = b.get("nodes", 1)
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise UserError(f"{path}: base.nodes must be a positive integer (got {nodes!r})")
    base = Base(config=str(b["config"]), model=str(b["model"]), mode=str(b["mode"]), nodes=nodes,
                cluster=str(b["cluster"]) if b.get("cluster") else None,
                flags=launcher_flags(_strs(b.get("flags"), f"{path}: base.flags"), f"{path}: base.flags"),
                sbatch=sbatch_options(b.get("sbatch"), f"{path}: base.sbatch"),
                overrides=_overrides(b.get("overrides"), f"{path}: base.overrides"))
    phases, explicit = _phases(raw.get("phases"), path)
    axes = _axes(raw, path)
    computed = _overrides(raw.get("computed"), f"{path}: computed")
    _refuse_phase_clashes(phases, axes, computed, path)
    n_runs = math.prod(len(ax.points) for ax in axes)
    if n_runs > MAX_RUNS:
        raise UserError(f"{path}: the axes expand to {n_runs} runs, more than {MAX_RUNS}; split the experiment "
                        "(one file per slice of the grid)")
    context = _base_context(base, root)
    runs = [_with_phases(name, run, phases, context) for run in _expand(name, base, axes, computed, context)]
    return Experiment(name=name, path=path.resolve(), base=base, phases=phases, runs=tuple(runs),
                      explicit_phases=explicit, description=str(raw.get("description") or ""))


def _with_phases(name: str, run: Run, phases: tuple[Phase, ...], context: dict) -> Run:
    """The run with each training phase's overrides resolved for it: ``${exp.name}``, ``${exp.label}`` (the run's
    label) and ``${exp.phase}`` (the phase's name), the run's own values and the base config, as in ``computed``.
    A phase's checkpoint folder is then written once for every run (``checkpoint.save: /ckpt/${exp.name}/
    ${exp.label}/${exp.phase}``), where before it had to be spelled out literally."""
    out: dict[str, dict[str, Any]] = {}
    for ph in phases:
        if not ph.overrides:
            continue
        values = {**run.overrides, **ph.overrides}
        ctx = {**context, "exp": {"name": name, "label": run.label, "phase": ph.name}}
        resolved = resolve_values(values, ctx, what=f"phase {ph.name!r} override")
        out[ph.name] = {k: resolved[k] for k in ph.overrides}
    return dataclasses.replace(run, phase_overrides=out)


def _refuse_phase_clashes(phases: tuple[Phase, ...], axes: list[_Axis], computed: dict[str, Any], path: Path) -> None:
    """A phase may not set what an axis sweeps: its value would replace the swept one in every run, which
    would go on being labelled, listed and exported to CSV with the value it did not run. So a phase override of
    a swept key is refused, and so is ``tokens:`` (it sets train.train_iters) on a phase that does not continue
    another training, when train.train_iters is swept (a continuing phase counts on from its start: the axis then
    sizes the phase it continues)."""
    swept = {k.lstrip("+~"): f"{ax.where} sweeps" for ax in axes for k in ax.keys}
    # a computed value is listed and exported to CSV as the run's own: a phase setting it would run another
    swept.update({k.lstrip("+~"): "computed sets" for k in computed if k.lstrip("+~") not in swept})

    def clash(key: str) -> str | None:  # the key itself, a section above it or a key inside it
        key = key.lstrip("+~")
        return next((s for s in swept if s == key or s.startswith(key + ".") or key.startswith(s + ".")), None)

    for i, ph in enumerate(phases):
        for k in ph.overrides:
            hit = clash(k)
            if hit is not None:
                what = k if hit == k.lstrip("+~") else f"{k} (which sets {hit})" if hit.startswith(k.lstrip("+~")) \
                    else f"{k} (inside {hit})"
                raise UserError(f"{path}: phases[{i}] ({ph.name}) overrides {what}, which {swept[hit]}: every "
                                "run would run the phase's value while named for its own; drop it from the phase (or "
                                "from the axis)")
        continues = ph.start is not None and any(p.name == ph.start and p.kind == "train" for p in phases)
        if ph.tokens is not None and not continues and "train.train_iters" in swept:
            raise UserError(f"{path}: phases[{i}] ({ph.name}) has tokens: {ph.tokens}, which sets train.train_iters, "
                            f"and {swept['train.train_iters']} train.train_iters: every run would run the "
                            "tokens' iterations while named for its own; keep one of the two")


def _base_context(base: Base, root: Path | None) -> dict:
    """The base training config (plain YAML) for interpolations such as ${model.seq_length}; {} if unreadable."""
    p = Path(base.config)
    if not p.is_absolute() and root is not None:
        p = root / p
    try:
        cfg = yamlio.load(p.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _phases(raw: Any, path: Path) -> tuple[tuple[Phase, ...], bool]:
    if raw is None:
        return (Phase(name="train"),), False
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{path}: phases must be a non-empty list")
    out: list[Phase] = []
    for i, p in enumerate(raw):
        where = f"{path}: phases[{i}]"
        p = _mapping(p, where)
        _check_unknown(p, PHASE_KEYS, where)
        name = str(p.get("name") or "")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}", name):
            raise UserError(f"{where}: name {name!r} must match [A-Za-z0-9][A-Za-z0-9_-]*")
        if any(q.name == name for q in out):
            raise UserError(f"{where}: phase {name!r} appears twice")
        kind = str(p.get("kind", "train"))
        if not is_phase_kind(kind):
            raise UserError(f"{where}: kind {kind!r} is not one of {', '.join(PHASE_KINDS)}")
        start = p.get("from", out[-1].name if out else None)
        if i == 0 and p.get("from") is not None:
            raise UserError(f"{where}: the first phase starts from nothing (remove 'from')")
        if start is not None and not any(q.name == start for q in out):
            raise UserError(f"{where}: from {start!r} is not an earlier phase")
        src = next((q for q in out if q.name == start), None)
        if kind == "train" and src is not None and src.kind != "train":
            raise UserError(f"{where}: a training phase starts from a training phase (not {src.kind} {src.name!r})")
        if kind == "export" and (src is None or src.kind != "train"):
            raise UserError(f"{where}: an export phase needs 'from' a training phase")
        if kind == "coherence" and src is None:
            raise UserError(f"{where}: a coherence phase needs 'from' an export or training phase")
        it = p.get("iteration", "last" if kind == "train" and src is not None else None)
        if it is not None and it != "last" and (not isinstance(it, int) or isinstance(it, bool) or it < 1):
            raise UserError(f"{where}: iteration must be 'last' or a positive integer (got {it!r})")
        if it is not None and (kind != "train" or src is None):
            raise UserError(f"{where}: iteration names the checkpoint a training phase starts from (needs 'from')")
        init = p.get("init", "continue" if kind == "train" and src is not None else None)
        if init is not None and (kind != "train" or src is None):
            raise UserError(f"{where}: init says how a training phase starts from another (needs 'from')")
        if init is not None and init not in INITS:
            raise UserError(f"{where}: init must be one of {', '.join(INITS)} (got {init!r})")
        tokens = p.get("tokens")
        if tokens is not None and (kind != "train" or not isinstance(tokens, int) or isinstance(tokens, bool)
                                   or not 1 <= tokens < CALC_INT_LIMIT):  # 10**400 would overflow
            raise UserError(f"{where}: tokens is a positive integer token budget of a training phase")
        ua = p.get("upload_all")
        if ua is not None and kind != "train":
            raise UserError(f"{where}: upload_all rides along a training phase")
        upload = None if ua in (None, False) else () if ua is True else _strs(ua, f"{where}: upload_all")
        if kind != "train" and p.get("overrides"):
            raise UserError(f"{where}: overrides belong to training phases; a {kind} phase takes args")
        if kind == "train" and p.get("args"):
            raise UserError(f"{where}: a training phase takes overrides, not args")
        out.append(Phase(name=name, kind=kind, start=start, iteration=it, init=init, tokens=tokens,
                         overrides=_overrides(p.get("overrides"), f"{where}: overrides"),
                         args=_strs(p.get("args"), f"{where}: args"),
                         sbatch=sbatch_options(p.get("sbatch"), f"{where}: sbatch", kind == "train"),
                         upload_all=upload))
    if out[0].kind != "train":
        raise UserError(f"{path}: the first phase must be a training phase")
    return tuple(out), True


NODES_AXIS = "nodes"  # grid: {nodes: [8, 16]} sweeps the node count (not a config key)


@dataclass(frozen=True)
class _Axis:
    """One axis: its points, each a (label part, {key: value}) pair."""
    keys: tuple[str, ...]
    points: tuple[tuple[str | None, dict[str, Any]], ...]
    where: str = ""  # how the file names it (grid.<key>, grid.<name>, zip)


def _axes(raw: dict, path: Path) -> list[_Axis]:
    axes: list[_Axis] = []
    grid = _mapping(raw.get("grid"), f"{path}: grid")
    for key, vals in grid.items():
        where = f"{path}: grid.{key}"
        if isinstance(vals, dict):  # a named axis: label -> overrides
            if not vals:
                raise UserError(f"{where}: a named axis needs at least one label")
            pts = []
            for label, ov in vals.items():
                if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.+-]*", str(label)):
                    raise UserError(f"{where}: label {label!r} must match [A-Za-z0-9][A-Za-z0-9.+-]*")
                pts.append((str(label), _overrides(ov, f"{where}.{label}")))
            keys = tuple(dict.fromkeys(k for _, ov in pts for k in ov))
            axes.append(_Axis(keys=keys, points=tuple(pts), where=f"grid.{key}"))
        elif key == NODES_AXIS:  # the node count: a run's own --nodes, planned and submitted with it
            if not isinstance(vals, list) or not vals or any(
                    not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in vals):
                raise UserError(f"{where}: the node axis is a non-empty list of positive integers (got {vals!r})")
            axes.append(_Axis(keys=(key,), points=tuple((None, {key: v}) for v in vals), where=f"grid.{key}"))
        else:
            _overrides({key: vals}, f"{path}: grid")
            if not isinstance(vals, list) or not vals:
                raise UserError(f"{where}: an override axis is a non-empty list of values")
            axes.append(_Axis(keys=(key,), points=tuple((None, {key: v}) for v in vals), where=f"grid.{key}"))
    z = _overrides(raw.get("zip"), f"{path}: zip")
    if z:
        lens = {k: len(v) if isinstance(v, list) else -1 for k, v in z.items()}
        if min(lens.values()) < 1 or len(set(lens.values())) != 1:
            got = ", ".join(f"{k}: {n}" for k, n in lens.items())
            raise UserError(f"{path}: zip needs lists of one length (got {got})")
        n = next(iter(lens.values()))
        axes.append(_Axis(keys=tuple(z), points=tuple((None, {k: z[k][i] for k in z}) for i in range(n)), where="zip"))
    seen: dict[str, int] = {}
    for i, ax in enumerate(axes):
        for k in ax.keys:
            if k in seen:
                raise UserError(f"{path}: {k} is swept by two axes (grid/zip); sweep each key once")
            seen[k] = i
    return axes


def _expand(name: str, base: Base, axes: list[_Axis], computed: dict[str, Any], context: dict) -> list[Run]:
    shorts = [short_key(k) for ax in axes if ax.points[0][0] is None for k in ax.keys]
    clash = {s for s in shorts if shorts.count(s) > 1}

    def part(ax: _Axis, point: tuple[str | None, dict[str, Any]]) -> str:
        label, ov = point
        if label is not None:
            return label
        return "_".join((k.lstrip("+").replace(".", "-") if short_key(k) in clash else short_key(k)) + fmt_value(v)
                        for k, v in ov.items())

    def resolve(values: dict[str, Any], label: str) -> dict[str, Any]:
        return resolve_values({**base.overrides, **values, **computed},
                              {**context, "exp": {"name": name, "label": label}})

    runs: list[tuple[str, dict, dict, int | None]] = []
    for combo in itertools.product(*(ax.points for ax in axes)) if axes else [()]:
        values: dict[str, Any] = {}
        for _, ov in combo:
            values.update(ov)
        label = "_".join(part(ax, pt) for ax, pt in zip(axes, combo)) or "base"
        nodes = values.pop(NODES_AXIS, None)  # not a config key: the run's node count (base.nodes otherwise)
        runs.append((label, values, resolve(values, label), nodes))
    labels = [r[0] for r in runs]
    out = []
    for label, values, ov, nodes in runs:
        first = label
        if labels.count(label) > 1:  # values that print alike: a stable hash of the run's overrides keeps names apart
            label = f"{label}-{hashlib.sha1(json.dumps(ov, sort_keys=True, default=str).encode()).hexdigest()[:6]}"
        if len(f"{name}.{label}") > 180:
            label = f"{label[:150]}-{hashlib.sha1(label.encode()).hexdigest()[:8]}"
        if label != first:  # ${exp.label} in computed resolved with the label the run has, not the one it shared with
            ov = resolve(values, label)  # another run (else two runs save into one folder)
        diff = {k: ov[k] for k in values}
        diff.update({k: ov[k] for k in computed if k not in diff})
        if nodes is not None:
            diff[NODES_AXIS] = nodes
        out.append(Run(label=label, values=diff, overrides=ov, nodes=nodes))
    if len({r.label for r in out}) != len(out):
        raise UserError(f"experiment {name}: two runs have identical overrides; remove the duplicate axis value")
    return out
