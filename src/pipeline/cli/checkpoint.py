"""pipeline_checkpoint_convert.sh - the checkpoint pipeline's actions.

  export CKPT_DIR --hf-model ID --reasoning|--no-reasoning [--iteration N] [--not-strict] [--push-to-hub]
         [--tp T --pp P --ep E]
         export one iteration (default: the latest complete one) to CKPT_DIR/iter_NNNNNNN/hf/, verified;
         Megatron checkpoints run one torchrun rank per GPU of one node, by default with the model's reference
         layout (Nano, Super: EP = the node's 4 GPUs); world = pp x lcm(tp, ep)
  import NAME|HF_ID [--output DIR] [--force] [--tp T --pp P --ep E]
         Hugging Face -> a checkpoint in our layout (Megatron via AutoBridge; local engine: HF weights); one
         process on one node, or model-parallel under torchrun (one rank per GPU, each saving its shard) for
         Super (its single-process import hangs) or with --tp/--pp/--ep: Super uses every GPU of the nodes it
         gets (the reference's --nodes=4: tp 1 pp 4 ep 4); `import nano` fetches the model the Nano config starts
         from (its -Base-BF16); the default output is the cluster profile's megatron_models_dir/<HF name>, where
         the shipped configs look
  upload-all CKPT_DIR --hf-model ID --reasoning|--no-reasoning [--poll] [--interval S] [--coherence]
         [--eval TASKS [--eval-limit N] [--eval-num-fewshot K] [--eval-batch-size B] [--eval-tasks-path DIR]]
         [--push-to-hub]
         convert every complete iteration exactly once, to CKPT_DIR/iter_NNNNNNN/hf/; nothing goes to the
         Hugging Face Hub without --push-to-hub (then each iteration to <token's user>/<run>-iter_NNNNNNN); with
         --poll keep watching until training ends; with --eval, lm-evaluation-harness on each verified export,
         once (hf/eval/<tasks>.json)

Every action takes --dry-run [--nodes N] [--json]: the plan (world size, nodes, layout, memory per GPU per
phase, launch line) without a GPU, container or Megatron Bridge; exit 2 when it cannot run, one line per problem.

--hf-model names the Hugging Face model the checkpoint belongs to (its architecture and tokenizer for the
Megatron path; recorded for the local engine). The reasoning choice is required, as in the reference:
it sets the exported chat template's enable_thinking default where the template has one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline import bridge
from pipeline.checkpoint import export as ex
from pipeline.checkpoint import plan as jobs
from pipeline.checkpoint.poll import earlier_failures, upload_all
from pipeline.checkpoint.verify import FAILED, VerificationFailed
from pipeline.cli.parser import Parser, bounded_float, path_arg
from pipeline.coherence.run import CoherenceRun
from pipeline.coherence.run import run as run_coherence
from pipeline.common import layout
from pipeline.common.argv import strip_options
from pipeline.common.errors import UserError, cli_main
from pipeline.common.io import read_json
from pipeline.common.log import setup_logging
from pipeline.config.cluster import resolve_profile
from pipeline.config.job_env import apply_job_env, job_environ
from pipeline.config.parallel import Layout
from pipeline.evaluation.run import EvalRun, overwrite_problem
from pipeline.evaluation.run import run as run_eval
from pipeline.evaluation.tasks import check_tasks
from pipeline.jobs.registry import Placement

SECONDS = bounded_float(0.001, 7 * 86400, "a number of seconds")  # --interval/--idle-timeout, checked by the plan


def _add_common(p: Parser) -> None:
    p.add_argument("ckpt_dir", type=path_arg)
    p.add_argument("--hf-model", required=True, help="HF id the checkpoint belongs to (architecture + tokenizer)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--reasoning", dest="reasoning", action="store_true")
    g.add_argument("--no-reasoning", dest="reasoning", action="store_false")
    p.add_argument("--not-strict", action="store_true", help="allow parameter-name mismatches (SFT without MTP)")
    # finite and in range: NaN compares false with everything, so --atol nan made the verification unable to fail
    p.add_argument("--atol", type=bounded_float(0.0, 1e6, "a logit difference"),
                   help="max |logit difference| of the verification (default: 1e-3 for a "
                   "local-engine (fp32) export, 4.0 for a Megatron (bf16) one; docs/benchmarks.md)")
    p.add_argument("--kl-tol", type=bounded_float(0.0, 1e6, "a KL divergence"),
                   help="mean KL(source || export) allowed (default 1e-6 fp32, 1e-2 bf16)")
    p.add_argument("--top1-min", type=bounded_float(0.0, 1.0, "a fraction"),
                   help="top-1 agreement required (default 1.0 fp32, 0.9 bf16)")
    p.add_argument("--require-quality", action="store_true",
                   help="also fail the verification on model quality (reference loss near a uniform guess, empty "
                        "generations); by default they are reported, and only conversion fidelity decides")
    p.add_argument("--force", action="store_true", help="re-export even when a verified hf/ exists")
    _add_layout(p)
    _add_plan(p)


def _add_layout(p: Parser) -> None:
    for flag in ("--tp", "--pp", "--ep"):
        p.add_argument(flag, type=int, help="model-parallel layout of a Megatron export (default: the model's "
                       "reference layout on the cluster profile; world = pp x lcm(tp, ep))")


def _add_plan(p: Parser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (2 when it cannot run)")
    p.add_argument("--nodes", type=int, help="with --dry-run outside an allocation: the node count Slurm will give")
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as one JSON object")


def build_parser() -> Parser:
    parser = Parser(prog="pipeline_checkpoint_convert.sh", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True, parser_class=Parser)
    e = sub.add_parser("export", help="export one iteration to HF, verified")
    _add_common(e)
    e.add_argument("--iteration", type=int)
    e.add_argument("--lock-held", action="store_true", help=argparse.SUPPRESS)  # upload-all holds the lock
    e.add_argument("--push-to-hub", action="store_true")
    e.add_argument("--hub-repo", help="repo id for --push-to-hub (default: <token's user>/<run name>-iter_NNNNNNN)")
    i = sub.add_parser("import", help="HF -> checkpoint")
    i.add_argument("hf_id")
    i.add_argument("--output", type=Path, help="default: the cluster profile's megatron_models_dir/<HF name> "
                   "(else $PIPELINE_MODELS_DIR/megatron_bridges/models/<HF name>): where the shipped configs' "
                   "checkpoint.pretrained_checkpoint looks")
    i.add_argument("--force", action="store_true")
    _add_layout(i)
    _add_plan(i)
    u = sub.add_parser("upload-all", help="convert every complete iteration exactly once")
    _add_common(u)
    u.add_argument("--poll", action="store_true", help="keep watching until training has finished")
    u.add_argument("--interval", type=SECONDS, default=60.0, help="seconds between polls")
    u.add_argument("--idle-timeout", type=SECONDS, help="stop polling after this many seconds without a new checkpoint")
    u.add_argument("--coherence", action="store_true", help="run the coherence test on each export")
    u.add_argument("--eval", metavar="TASKS", help="evaluate each verified export on these lm-eval tasks "
                   "(comma-separated; pipeline_smoke is the local one), once per iteration")
    u.add_argument("--eval-limit", type=float, help="--eval: examples per task")
    u.add_argument("--eval-num-fewshot", type=int, help="--eval: few-shot examples (default: each task's own)")
    u.add_argument("--eval-batch-size", type=int, default=8)
    u.add_argument("--eval-tasks-path", action="append", type=Path, default=[], metavar="DIR",
                   help="--eval: a folder of task YAMLs to add (repeatable)")
    u.add_argument("--eval-force", action="store_true", help="--eval: replace results of these tasks that were "
                   "measured with other settings, or of another model (otherwise the plan refuses them)")
    u.add_argument("--push-to-hub", action="store_true")
    return parser


@dataclass(frozen=True)
class ConvertRequest:
    """One command line of the checkpoint pipeline, read once from ``build_parser``'s namespace (``from_args``):
    every action's options, typed, with the defaults of those the action has not (an export has no --eval, an
    import no --hf-model). The plan (``plan_request``) and the actions read this, never the namespace."""

    action: str
    argv: tuple[str, ...] = ()  # the command line as given (the plan's launch line repeats it)
    ckpt_dir: Path | None = None
    hf_model: str = ""
    reasoning: bool = False
    not_strict: bool = False
    atol: float | None = None
    kl_tol: float | None = None
    top1_min: float | None = None
    require_quality: bool = False
    force: bool = False
    tp: int | None = None  # None: the plan chooses the model's layout
    pp: int | None = None
    ep: int | None = None
    dry_run: bool = False
    nodes: int | None = None
    json: bool = False
    iteration: int | None = None  # export
    lock_held: bool = False
    push_to_hub: bool = False
    hub_repo: str | None = None
    hf_id: str = ""  # import
    output: Path | None = None
    poll: bool = False  # upload-all
    interval: float = 60.0
    idle_timeout: float | None = None
    coherence: bool = False
    eval: str | None = None  # --eval '' is checked (and refused), not read as no --eval
    eval_limit: float | None = None
    eval_num_fewshot: int | None = None
    eval_batch_size: int = 8
    eval_tasks_path: tuple[Path, ...] = ()
    eval_force: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, argv: list[str] | tuple[str, ...] = ()) -> ConvertRequest:
        given = vars(args)
        values = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
        values["eval_tasks_path"] = tuple(values.get("eval_tasks_path", ()))
        return cls(**values, argv=tuple(argv))

    def export(self, lay: Layout) -> ex.ExportRequest:
        """One iteration's export on the plan's layout; upload-all holds the iteration's lock (and passes
        --lock-held to the torchrun of each iteration)."""
        return ex.ExportRequest(hf_model=self.hf_model, reasoning=self.reasoning, strict=not self.not_strict,
                                atol=self.atol, kl_tol=self.kl_tol, top1_min=self.top1_min,
                                require_quality=self.require_quality, force=self.force, layout=lay,
                                locked=self.action == "upload-all" or self.lock_held)

    def eval_run(self, hf: Path):
        """upload-all's evaluation of one export (``--eval TASKS``), None without --eval."""
        if self.eval is None:
            return None

        return EvalRun(model=str(hf), tasks=self.eval, tasks_path=self.eval_tasks_path,
                       num_fewshot=self.eval_num_fewshot, batch_size=self.eval_batch_size, limit=self.eval_limit,
                       quiet=True, force=self.eval_force)


# the evaluation's own option names in its messages, as upload-all's user typed them (--eval-limit, not --limit)
EVAL_OPTION_NAMES = re.compile(r"--(limit|num-fewshot|batch-size|tasks-path|tasks)\b")


def check_eval(cfg) -> None:
    """upload-all's evaluation settings checked by the evaluation's own rule, its messages naming the options as
    upload-all's user typed them (``--eval-limit``, not ``--limit``)."""
    try:
        cfg.check()
    except UserError as exc:
        raise UserError(EVAL_OPTION_NAMES.sub(lambda m: "--eval" if m.group(1) == "tasks" else f"--eval-{m.group(1)}",
                                              str(exc))) from None


def plan_request(req: ConvertRequest, nodes: int | None = None, inputs_later: bool = False,
                 cluster: str | None = None) -> jobs.JobPlan:
    """The plan of a command line (``nodes``: Slurm's count when --nodes is not given; ``inputs_later``: the job
    waits for the one that writes its checkpoint; ``cluster``: the profile, else PIPELINE_CLUSTER's)."""
    rest = strip_options(list(req.argv), ("--dry-run", "--json"), ("--nodes",))
    nodes = req.nodes if req.nodes is not None else nodes
    if req.action == "import":
        return jobs.plan_import(req.hf_id, req.output, nodes=nodes, cluster=cluster, argv=rest, tp=req.tp, pp=req.pp,
                                ep=req.ep, force=req.force)
    assert req.ckpt_dir is not None  # export and upload-all: a required positional
    plan = jobs.plan_export(jobs.ExportJob(req.ckpt_dir, req.hf_model, tp=req.tp, pp=req.pp, ep=req.ep,
                                           iteration=req.iteration, nodes=nodes, cluster=cluster, job=req.action,
                                           argv=tuple(rest),
                                           inputs_later=inputs_later, strict=not req.not_strict,
                                           push_to_hub=req.push_to_hub))
    skipped = earlier_failures(req.ckpt_dir, exported=_exported) \
        if req.action == "upload-all" and req.ckpt_dir.is_dir() else {}
    plan.problems += hf_output_problems(req, skipped)
    for it, why in skipped.items():  # named in the plan
        plan.notes.append(f"{layout.iter_dirname(it)} is skipped: {why}")
    cfg = req.eval_run(layout.iter_dir(req.ckpt_dir, 0) / "hf")
    if cfg is not None:  # the tasks' data reachable here, before any conversion or model load

        check_eval(cfg)
        plan.problems += check_tasks(cfg.task_names, cfg.tasks_path, resolve_profile(cluster))
        plan.problems += earlier_results(req)
    return plan


def _exported(iter_path: Path) -> bool:
    return ex.published_export(iter_path / "hf") is not None


def hf_output_problems(req: ConvertRequest, skipped: dict[int, str]) -> list[str]:
    """The export's own hf/ rule (``export.hf_output_problem``), applied in the plan to every iteration the job
    would export: else the dry run says OK for an hf/ holding a user's file (with --force) or linked to a user's
    folder, and the job refuses only when it gets there. An iteration already exported and
    verified is skipped by the job (without --force), and so is one whose earlier attempt failed (``skipped``:
    upload-all's :func:`earlier_failures`)."""
    ckpt = req.ckpt_dir
    assert ckpt is not None
    if not ckpt.is_dir():
        return []
    try:
        if req.action == "export":
            iters = [layout.resolve_iteration(ckpt, req.iteration)]
        else:
            iters = [layout.iter_dir(ckpt, it) for it in layout.complete_iterations(ckpt) if it not in skipped]
    except (UserError, OSError):  # no such iteration, or an unreadable folder: the plan says so elsewhere
        return []
    out = []
    for it in iters:
        if _exported(it) and not req.force:
            continue
        try:
            problem = ex.hf_output_problem(it / "hf")
        except OSError as exc:
            problem = f"export output {it / 'hf'} cannot be read ({exc.strerror or exc})"
        if problem:
            out.append(problem)
    return out


# upload-all's own way out of an evaluation that would replace other results (it has no --force/--output-dir)
UPLOAD_ALL_EVAL_FIX = ("rerun upload-all with --eval-force to replace them, or keep the --eval settings they were "
                       "made with")


def earlier_results(req: ConvertRequest) -> list[str]:
    """Iterations whose exports hold results of these tasks measured with other settings (or of another model):
    the job's evaluation would refuse each and mark it failed, so the plan says so first, once, with upload-all's
    option (else the dry run says OK, and the job marks every iteration .failed and exits 1)."""
    assert req.ckpt_dir is not None
    if not req.ckpt_dir.is_dir():
        return []
    clashes = []
    for it in layout.complete_iterations(req.ckpt_dir):
        cfg = req.eval_run(layout.iter_dir(req.ckpt_dir, it) / "hf")
        problem = overwrite_problem(cfg, UPLOAD_ALL_EVAL_FIX) if cfg is not None else None
        if problem:
            clashes.append((it, problem))
    if not clashes:
        return []
    its = ", ".join(layout.iter_dirname(it) for it, _ in clashes[:5]) + (" ..." if len(clashes) > 5 else "")
    return [f"{len(clashes)} iteration(s) ({its}) already hold other results; the first: {clashes[0][1]}"]


def parse(argv: list[str]) -> ConvertRequest:
    return ConvertRequest.from_args(build_parser().parse_args(argv), argv)


def plan_from_argv(argv: list[str], nodes: int | None = None, inputs_later: bool = False) -> jobs.JobPlan:
    """The plan of ``pipeline_checkpoint_convert.sh ARGS`` (a dry run's)."""
    return plan_request(parse(argv), nodes, inputs_later)


parse_job = parse  # the registry's parser (jobs/registry.py): the batch script's words -> the request


def plan_job(req: ConvertRequest, placement: Placement) -> jobs.JobPlan:
    """The registry's planner: the request placed as a submission places it (its own --nodes, a dry run's
    option, must be the allocation's)."""
    placement.check_own_nodes(req.nodes, "the job's")
    return plan_request(req, placement.nodes, placement.inputs_later, cluster=placement.cluster)


def export_torchrun(iter_path: Path, req: ConvertRequest, plan: jobs.JobPlan) -> tuple[list[str], dict[str, str]]:
    """upload-all's export of one iteration on the node's GPUs: the torchrun line (the plan's layout, the poller's
    lock held) and the environment its ranks get (the cluster profile's env over this process's)."""
    cmd = ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={plan.layout.world}", "-m",
           "pipeline.cli.checkpoint", "export", str(req.ckpt_dir), "--iteration",
           str(layout.iteration_number(iter_path)), *req.export(plan.layout).argv()]  # upload-all's: locked
    return cmd, job_environ(plan.env)


def _export_in_torchrun(iter_path: Path, req: ConvertRequest, plan: jobs.JobPlan) -> dict:
    """upload-all of a Megatron checkpoint on several GPUs: the poller stays one process and each iteration is
    exported by its own torchrun on the node's GPUs (the plan's layout), holding the poller's lock."""
    cmd, env = export_torchrun(iter_path, req, plan)
    print("launching: " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, env=env).returncode
    rec = ex.published_export(iter_path / "hf")
    if rc != 0 or rec is None:
        failed = iter_path / FAILED
        raise VerificationFailed(read_json(failed) if failed.is_file() else
                                    {"failures": [f"the export's torchrun exited {rc} (see its log above)"]})
    return rec


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    req = parse(argv)
    setup_logging()
    plan = plan_request(req)
    if req.dry_run:
        return jobs.print_plan(plan, req.json)
    jobs.refuse(plan)
    # The cluster profile's env for this process (a one-process export, import or upload-all runs here), the
    # torchrun it execs and the ranks: before anything initialises torch.distributed / NCCL.
    apply_job_env(plan.env)
    if req.action == "import":
        fetch, out, megatron = jobs.import_target(req.hf_id, req.output, resolve_profile())
        if plan.world > 1 and "LOCAL_RANK" not in os.environ:  # one torchrun per node, a rank per GPU
            ex.check_import_target(out, force=req.force)
            bridge.require_bridge(f"importing {fetch} as a Megatron checkpoint")  # here, not on every rank
            print("launching: " + " ".join(plan.launch), flush=True)
            os.execvp(plan.launch[0], plan.launch)
        lay = plan.layout
        target = ex.import_hf(fetch, out, megatron=megatron, force=req.force, tp=lay.tp, pp=lay.pp, ep=lay.ep)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        print(f"imported {fetch} -> {target}")
        print(f"use it with: checkpoint.pretrained_checkpoint={out}")
        return 0

    assert req.ckpt_dir is not None  # export and upload-all: a required positional
    ckpt_dir, export = req.ckpt_dir, req.export(plan.layout)
    hub_user = ""
    if req.push_to_hub and "LOCAL_RANK" not in os.environ:  # before hours of conversion: the token and its rights
        hub_user = ex.check_hub_access(req.hub_repo)

    def convert(iter_path: Path) -> dict:
        if req.action == "upload-all" and plan.world > 1:
            rec = _export_in_torchrun(iter_path, req, plan)
        else:
            rec = ex.export_iteration(iter_path, export)
        if rec.get("verdict") == "rank":  # a non-zero rank of a model-parallel export: rank 0 reports
            return rec
        if req.coherence:
            rc = run_coherence(CoherenceRun(model=str(iter_path / "hf"), reasoning=req.reasoning, quiet=True))
            rec = {**rec, "coherence_exit_code": rc}
        if req.push_to_hub:
            rec = {**rec, "hub_url": ex.push_to_hub(iter_path / "hf", hub_repo(iter_path))}
        return rec

    def hub_repo(iter_path: Path) -> str:
        if req.hub_repo:
            return req.hub_repo
        user = hub_user or ex.check_hub_access()  # a torchrun rank: its launcher checked before the exec
        return f"{user}/{jobs.hub_repo_name(ckpt_dir, iter_path.name)}"

    if req.action == "export":
        iter_path = layout.resolve_iteration(ckpt_dir, req.iteration)
        if plan.world > 1 and "LOCAL_RANK" not in os.environ:
            bridge.require_bridge(f"exporting the Megatron checkpoint {iter_path}")  # fail here, not on every rank
            print("launching: " + " ".join(plan.launch), flush=True)
            os.execvp(plan.launch[0], plan.launch)
        try:
            rec = convert(iter_path)
            if rec.get("verdict") == "rank":
                return 0
        except VerificationFailed as exc:
            print(f"error: export of {iter_path} FAILED verification: {exc}", file=sys.stderr)
            print(f"details: {iter_path / FAILED}", file=sys.stderr)
            return 1
        print(json.dumps({k: rec[k] for k in ("verdict", "max_abs_logit_diff", "kl", "top1_agreement", "reference_loss",
                                                    "uniform_loss")
                          if k in rec}, indent=2))
        print(f"exported: {iter_path / 'hf'}")
        return 0

    if not ckpt_dir.is_dir():
        raise UserError(f"checkpoint directory {ckpt_dir} does not exist")
    if not req.poll and not layout.list_iterations(ckpt_dir) and layout.read_tracker(ckpt_dir) is None:
        raise UserError(f"{ckpt_dir} holds no iter_NNNNNNN checkpoints (is it the run's checkpoints/ folder? "
                        "--poll waits for the first one)")
    evaluate = None
    if req.eval:
        def evaluate(iter_path: Path) -> dict:
            cfg = req.eval_run(iter_path / "hf")
            return run_eval(cfg, UPLOAD_ALL_EVAL_FIX) if cfg is not None else {}

    probe = req.eval_run(ckpt_dir / "hf")  # its settings were checked by the plan, before any export
    key = probe.marker_key() if probe is not None else "eval"
    conv, failed = upload_all(ckpt_dir, convert, poll=req.poll, interval=req.interval,
                              idle_timeout=req.idle_timeout, evaluate=evaluate, eval_key=key,
                              exported=_exported,
                              evaluated=lambda it: probe is None or req.eval_run(it / "hf").out_file.is_file())
    print(f"upload-all: converted {len(conv)} iteration(s) {conv}; failed {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
