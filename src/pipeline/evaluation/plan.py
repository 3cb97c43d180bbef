"""The evaluation job's plan (``checkpoint/plan.py`` for the shared pieces), before the job is queued: one node,
the model on one GPU when it fits, else over the node's GPUs (the harness's ``parallelize``: Accelerate's
device_map="auto"); the tasks' data reachable on this cluster, checked before any model loads."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoint.plan import JobPlan, cluster_and_nodes, hf_gb, local_path
from pipeline.coherence.plan import hf_size
from pipeline.common.io import folder_problem
from pipeline.config.cluster import resolve_profile
from pipeline.config.job_env import job_env
from pipeline.config.models import spec_for
from pipeline.config.parallel import Layout
from pipeline.env.runtimes import invisible_paths
from pipeline.evaluation.run import overwrite_problem
from pipeline.evaluation.tasks import check_tasks, harness_installed

MODULE = ["-m", "pipeline.cli.evaluation"]
MAX_LENGTH = 2048  # the context a request is cut to for the memory estimate (the harness: the model's, at most)


def plan_evaluate(cfg, *, nodes: int | None = None, cluster: str | None = None, argv: list[str] | None = None,
                  inputs_later: bool = False, check_data: bool = True) -> JobPlan:
    """``cfg``: the EvalRun. ``inputs_later``: the job waits for the export, so a model folder that does not exist
    yet is not a problem. ``check_data``: refuse tasks whose data this cluster cannot reach (reads task files)."""
    profile, n_nodes, _ = cluster_and_nodes(nodes, cluster)
    gpn = profile.ranks_per_node
    plan = JobPlan(kind="evaluate", model=cfg.model, cluster=profile.name, profile=profile, nodes=1, ranks_per_node=1,
                   layout=Layout(1), engine="hf", env=job_env(profile.env), memory_budget_gb=profile.memory_budget_gb,
                   launch=["python", *MODULE, *(argv or [])],
                   gpus_needed=1 if profile.has_gpus else 0)
    if n_nodes > 1:
        plan.problems.append(f"an evaluation runs on one node, and {n_nodes} were asked for: submit it with --nodes=1")
    spec = spec_for(cfg.model)
    if spec is not None and cfg.model == spec.name:
        plan.problems.append(f"{cfg.model!r} is a registry name, not a model: give the HF directory (an export's "
                             f"hf/) or the hub id {spec.hf_id}")
    elif not inputs_later and not Path(cfg.model).exists() and ("/" not in cfg.model or
                                                                 cfg.model.startswith((".", "/"))):
        plan.problems.append(f"model {cfg.model} does not exist (an export's hf/ folder or a hub id ORG/NAME)")
    if check_data:
        plan.problems += check_tasks(cfg.task_names, tuple(cfg.tasks_path), profile)
        if not harness_installed():
            plan.notes.append("lm-eval is not installed here (the login node's planner): the job checks that its "
                              "tasks' data is reachable before it loads the model")

    problem = overwrite_problem(cfg)  # earlier results of other settings: refused before the job is queued
    if problem:
        plan.problems.append(problem)
    out_problem = folder_problem(cfg.out_file.parent)  # before the job: the results are written after the evaluation
    if out_problem:
        plan.problems.append(f"the results folder {cfg.out_file.parent}: {out_problem} (--output-dir names a folder)")
    checked = [("model", cfg.model)] if local_path(str(cfg.model)) else []
    checked += [("tasks path", p) for p in cfg.tasks_path]
    plan.problems += invisible_paths(resolve_profile(cluster), checked)
    size = hf_size(cfg.model)
    if size is None:
        plan.notes.append(f"no size facts for {cfg.model}: memory not estimated")
        return plan
    billions, vocab, src = size
    gb, gpus = hf_gb(billions, max(1, gpn), profile.memory_budget_gb, cfg.batch_size * MAX_LENGTH, vocab)
    plan.memory_gb = {"evaluate": round(gb, 1)}
    plan.gpus_needed = gpus if profile.has_gpus else 0
    plan.notes.append(f"{billions:.1f}B parameters ({src}); " +
                      ("on one GPU" if gpus == 1 else f"over the node's {gpus} GPUs (the harness's parallelize)"))
    if gpus > 1:
        plan.env = {**plan.env, "PIPELINE_EVAL_PARALLELIZE": "1"}
    if profile.memory_budget_gb and gb > profile.memory_budget_gb:
        plan.problems.append(f"estimated {gb:.1f} GB per GPU > {profile.memory_budget_gb:g} GB on '{profile.name}' "
                             f"even over the node's {gpus} GPUs: lower --batch-size")
    return plan
