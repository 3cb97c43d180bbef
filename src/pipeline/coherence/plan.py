"""The coherence job's plan (``checkpoint/plan.py`` for the shared pieces): where each backend runs and whether it
fits, before the job is queued.

  hf        one node; the model on one GPU when it fits, else over the node's GPUs (device_map="auto")
  endpoint  one process, no GPU (the server does the work)
  megatron  one rank per GPU over as many nodes as the layout needs (world = pp x lcm(tp, ep x etp), etp 1):
            one torchrun per node, a c10d rendezvous on the first node; without --tp/--pp/--ep the smallest
            layout that fits the model
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline import bridge
from pipeline.checkpoint.plan import (
    JobPlan,
    check_gpus_on_node,
    cluster_and_nodes,
    fitting_layout,
    hf_gb,
    job_world,
    layout_flags,
    local_path,
    megatron_gb,
    placement,
    shape_problems_with_fix,
)
from pipeline.checkpoint.plan import torchrun_line as jobs_torchrun_line
from pipeline.coherence.backends import MEGATRON, backend, discovery_file_problem, model_bytes
from pipeline.coherence.run import megatron_iteration, wandb_run_name, wandb_target
from pipeline.common.errors import UserError
from pipeline.config.cluster import resolve_profile
from pipeline.config.job_env import job_env
from pipeline.config.models import ModelSpec, spec_for
from pipeline.config.parallel import Layout, node_local_problems
from pipeline.env.runtimes import invisible_paths

MODULE = ["-m", "pipeline.cli.coherence"]


def hf_size(model: str) -> tuple[float, int, str] | None:
    """(billions of parameters, vocab, where from) of an HF model: the registry, else a local folder's safetensors
    sizes (BF16 on disk: 2 bytes per parameter; FP32 exports count double, which errs on the safe side); a folder
    without its weights yet (a job that waits for the export) from the registry model it is exported from
    (``pipeline_export.json``'s hf_model), else from its ``config.json``'s architecture."""
    spec = spec_for(model)
    if spec is not None:
        return spec.total_params_b, spec.vocab_size, "registry"
    p = Path(model)
    if p.is_dir():
        cfg = _read_json(p / "config.json")
        vocab = _int(cfg.get("vocab_size"))
        size = model_bytes(model)  # the hf backend's own sizing: the folder's safetensors
        if size:
            return size / 2 / 1e9, vocab, "safetensors size"
        source = spec_for(str(_read_json(p / "pipeline_export.json").get("hf_model") or ""))
        if source is not None and source.total_params_b:
            return source.total_params_b, source.vocab_size, f"weights not written yet: {source.hf_id}, the registry"
        billions = config_params_b(cfg)
        if billions:
            return billions, vocab, "weights not written yet: config.json's architecture"
    return None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _int(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def config_params_b(cfg: dict) -> float:
    """Billions of parameters of a decoder from its Hugging Face config (embeddings, attention, dense MLP, routed
    and shared experts per layer): an estimate for sizing, 0.0 when the config does not say enough."""
    h, vocab = _int(cfg.get("hidden_size")), _int(cfg.get("vocab_size"))
    blocks = cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern") or ""
    layers = _int(cfg.get("num_hidden_layers")) or len(blocks)
    if not (h and vocab and layers):
        return 0.0
    heads = _int(cfg.get("num_attention_heads")) or 1
    hd = _int(cfg.get("head_dim")) or h // heads
    kv = _int(cfg.get("num_key_value_heads")) or heads
    attn = h * hd * (2 * heads + 2 * kv)
    experts = _int(cfg.get("n_routed_experts")) or _int(cfg.get("num_experts")) or _int(cfg.get("num_local_experts"))
    moe_inter = _int(cfg.get("moe_intermediate_size"))
    inter = _int(cfg.get("intermediate_size"))
    shared = _int(cfg.get("moe_shared_expert_intermediate_size")) * max(1, _int(cfg.get("n_shared_experts")))
    mlp = 3 * h * (experts * moe_inter + shared) if experts and moe_inter else 3 * h * inter
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return (embed + layers * (attn + mlp)) / 1e9


def torchrun_line(world: int, nodes: int, procs: int, argv: list[str], port: int) -> list[str]:
    """The per-node launcher of the megatron backend (``pipeline.checkpoint.plan.torchrun_line``)."""
    return jobs_torchrun_line(MODULE, world, nodes, procs, argv, port, "coherence")


def plan_coherence(cfg, *, nodes: int | None = None, cluster: str | None = None,
                   argv: list[str] | None = None, inputs_later: bool = False) -> JobPlan:
    """``cfg``: the CoherenceRun (its tp/pp/ep None when not given). ``inputs_later``: the job waits for another
    (an export), so a model path that does not exist yet is not a problem. Every path the job reads, as the
    container sees it: one outside the checkout and every bind is a problem naming the bind to add."""
    plan = _plan_coherence(cfg, nodes=nodes, cluster=cluster, argv=argv, inputs_later=inputs_later)
    b = backend(cfg.backend)
    models = [] if b.remote else [cfg.model, *(cfg.compare if b.reads_hf else [])]
    checked = [("model", m) for m in models if m and local_path(str(m))]
    if b.remote and cfg.discovery_file is not None:
        checked.append(("discovery file", cfg.discovery_file))
    profile = resolve_profile(cluster)
    plan.problems += invisible_paths(profile, checked)
    if not cfg.no_wandb:
        project, entity = wandb_target(cfg, profile)
        shown = entity or "(the W&B key's default)"
        plan.notes.append(f"W&B: project {project}, entity {shown}, run "
                          f"{wandb_run_name(cfg)}")
    return plan


def _plan_coherence(cfg, *, nodes: int | None, cluster: str | None, argv: list[str] | None,
                    inputs_later: bool) -> JobPlan:
    profile, n_nodes, given = cluster_and_nodes(nodes, cluster)
    argv = list(argv or [])
    gpn = profile.ranks_per_node
    env = job_env(profile.env)  # what the launch sets for the job's ranks (the cluster profile's env)
    b = backend(cfg.backend)
    if b.remote:
        plan = JobPlan(kind="coherence", model=cfg.model, cluster=profile.name, profile=profile, nodes=1,
                       ranks_per_node=1, layout=Layout(1), engine=b.name, gpus_needed=0, env=env,
                       launch=["python", *MODULE, *argv], notes=["endpoint backend: the server generates; no GPU"])
        if n_nodes > 1:
            plan.problems.append(f"the endpoint backend runs on one node (the server generates), and {n_nodes} were "
                                 "asked for: submit it with --nodes=1")
        problem = discovery_file_problem(Path(cfg.discovery_file)) if cfg.discovery_file is not None else None
        if problem and not inputs_later:  # a job that waits for the serving job reads the file when it starts
            plan.problems.append(problem)
        return plan
    if b.reads_hf:
        plan = JobPlan(kind="coherence", model=cfg.model, cluster=profile.name, profile=profile, nodes=1,
                       ranks_per_node=1, layout=Layout(1), engine=b.name, env=env,
                       memory_budget_gb=profile.memory_budget_gb, launch=["python", *MODULE, *argv],
                       gpus_needed=1 if profile.has_gpus else 0)
        if any(v not in (None, 1) for v in (cfg.tp, cfg.pp, cfg.ep)):
            plan.problems.append("--tp/--pp/--ep apply to the megatron backend only")
        if n_nodes > 1:
            plan.problems.append(f"the hf backend runs on one node, and {n_nodes} were asked for: submit it with "
                                 "--nodes=1")
        for m in [cfg.model, *cfg.compare]:
            spec = spec_for(m)
            if spec is not None and m == spec.name:
                plan.problems.append(f"{m!r} is a registry name, not a model: give the HF directory (an export's hf/) "
                                     f"or the hub id {spec.hf_id}")
            elif not inputs_later and not Path(m).exists() and ("/" not in m or m.startswith((".", "/"))):
                plan.problems.append(f"model {m} does not exist (a local HF directory or a hub id ORG/NAME)")
        # the models generate one after another: the job is sized for the largest (a --compare model too: a
        # Super compared with a 135M model had been planned on one GPU)
        tokens = cfg.max_tokens + 256
        sized = []
        for m in dict.fromkeys([cfg.model, *cfg.compare]):
            size = hf_size(m)
            if size is None:
                plan.notes.append(f"no size facts for {m}: memory not estimated")
                continue
            billions, vocab, src = size
            gb, gpus = hf_gb(billions, max(1, gpn), profile.memory_budget_gb, tokens, vocab)
            sized.append((gb, gpus, m, billions, src))
            plan.notes.append((f"{m}: " if cfg.compare else "") + f"{billions:.1f}B parameters ({src}); " +
                              ("on one GPU" if gpus == 1 else f"over the node's {gpus} GPUs (device_map='auto')"))
        if not sized:
            return plan
        gb, gpus = max(t[0] for t in sized), max(t[1] for t in sized)
        plan.memory_gb = {"generate": round(gb, 1)}
        plan.gpus_needed = gpus if profile.has_gpus else 0
        if profile.memory_budget_gb and gb > profile.memory_budget_gb:
            plan.problems.append(f"estimated {gb:.1f} GB per GPU > {profile.memory_budget_gb:g} GB on "
                                 f"'{profile.name}' even over the node's {gpus} GPUs: use the megatron backend on "
                                 "more nodes")
        return plan
    return _plan_megatron(cfg, profile, n_nodes, given, argv, inputs_later)


def _peft_refusal(cfg) -> str | None:
    """A PEFT (LoRA) iteration holds only adapter weights: the megatron backend cannot generate from it (the line
    names the export that merges them, and coherence on its hf/). None where the iteration is whole or cannot be
    resolved yet (a job waiting for another; the run resolves it again and ``bridge.generate`` refuses too)."""
    try:
        peft = bridge.peft_iteration(megatron_iteration(cfg.model, cfg.iteration))
    except (UserError, OSError, ValueError):
        return None
    return bridge.generation_refusal(peft, cfg.hf_model) if peft is not None else None


def _checkpoint_problem(cfg) -> str | None:
    """Why the iteration the megatron backend would generate from cannot be read (a missing directory, no complete
    iteration, a missing --iteration): the plan had passed them and the job failed on every rank."""
    try:
        megatron_iteration(cfg.model, cfg.iteration)
    except UserError as exc:
        return str(exc)
    except OSError as exc:
        return f"checkpoint {cfg.model} cannot be read ({exc.strerror or exc})"
    return None


def _plan_megatron(cfg, profile, n_nodes: int, given: bool, argv: list[str], inputs_later: bool = False) -> JobPlan:
    gpn = profile.ranks_per_node
    spec: ModelSpec | None = spec_for(cfg.hf_model) if cfg.hf_model else None
    notes = []
    tokens = cfg.max_tokens + 256
    flags = (cfg.tp, cfg.pp, cfg.ep)
    if all(v is None for v in flags):
        fit = fitting_layout(spec, profile, lambda lay: megatron_gb(spec, lay, tokens)) if spec else None
        lay = fit or Layout(1)
        notes.append(f"layout: the smallest that fits ({layout_flags(lay)})" if fit else
                     "layout: tp 1 pp 1 ep 1 (no size facts to choose a larger one)")
    else:
        tp, pp, ep = (v or 1 for v in flags)
        lay = Layout(job_world(tp, pp, ep), tp=tp, pp=pp, ep=ep, etp=1)
    nodes, procs, fill = placement(lay.world, gpn)
    plan = JobPlan(kind="coherence", model=cfg.model, cluster=profile.name, profile=profile, nodes=nodes,
                   ranks_per_node=procs, layout=lay, engine=MEGATRON.name,
                   memory_budget_gb=profile.memory_budget_gb, notes=notes, env=job_env(profile.env))
    if not cfg.hf_model:
        plan.problems.append("the megatron backend needs --hf-model ID (the checkpoint's architecture and tokenizer)")
    problem = None if inputs_later else _checkpoint_problem(cfg)  # a job after an import reads it when it starts
    if problem:
        plan.problems.append(problem)
    refusal = _peft_refusal(cfg)
    if refusal:
        plan.problems.append(refusal)
    if not profile.has_gpus:
        plan.problems.append(f"the megatron backend runs on GPUs; cluster profile '{profile.name}' has none "
                             "(select a GPU profile: PIPELINE_CLUSTER=isambard_gh200)")
    plan.problems += lay.problems()
    plan.problems += node_local_problems(lay, gpn, f"on '{profile.name}'")
    plan.problems += shape_problems_with_fix(spec, lay, profile, lambda cand: megatron_gb(spec, cand, tokens)
                                             if spec else 0.0)
    if fill:
        plan.problems.append(fill)
    if given and n_nodes != nodes:
        plan.problems.append(f"the layout {layout_flags(lay)} needs {nodes} node(s) of {gpn} GPUs ({lay.world} "
                             f"ranks), and the allocation has {n_nodes}: submit it with --nodes={nodes}")
    plan.launch = ["python", *MODULE, *argv] if lay.world == 1 else \
        torchrun_line(lay.world, nodes, procs, argv, profile.rdzv_port)
    check_gpus_on_node(plan)
    if spec is None:
        if cfg.hf_model:
            plan.notes.append(f"{cfg.hf_model} is not in the model registry: memory not estimated")
        return plan
    plan.memory_gb = {"generate": round(megatron_gb(spec, lay, tokens), 1)}
    if profile.memory_budget_gb and plan.memory_per_gpu_gb > profile.memory_budget_gb:
        fit = fitting_layout(spec, profile, lambda cand: megatron_gb(spec, cand, tokens))
        fix = f": use {layout_flags(fit)} on {placement(fit.world, gpn)[0]} node(s)" if fit else ""
        plan.problems.append(f"estimated {plan.memory_per_gpu_gb:.1f} GB per GPU > {profile.memory_budget_gb:g} GB "
                             f"on '{profile.name}' with {layout_flags(lay)}{fix}")
    return plan
