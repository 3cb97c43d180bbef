"""Megatron's parallel layout without Megatron: the rank -> group mapping of the pinned megatron-core, the node-local
rule and the per-GPU weight share, for every GPU job (training, export, import, generation) alike.

Megatron's rules (megatron-core 0.19 ``parallel_state.initialize_model_parallel``):
  world = tp x pp x cp x dp                         the dense (attention, Mamba, MLP) grid, order tp-cp-dp-pp
  world = etp x ep x pp x edp                       the expert grid, order tp-ep-dp-pp (tp there is etp)
  etp defaults to tp (``expert_tensor_parallel_size=None``); with etp != tp the expert grid is "folded"
  independently of the dense one, so expert parallelism spreads over the data (and tensor) ranks of a pipeline
  stage and never multiplies the world size.

``groups`` reproduces ``RankGenerator.get_ranks`` (``generate_masked_orthogonal_rank_groups``) exactly; the
bridge harness test compares it with megatron-core's own for many layouts. ``node_local_problems`` is the one
statement of the node-local rule: every TP, CP and expert (EP x ETP) group lies inside one node (NVLink), because
their collectives run every layer; the reference's "TP x EP <= 4" is this rule when etp = tp. Pure Python, no
torch: the login-node planner imports it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

MAX_WORLD = 65536  # more ranks than any cluster job; a larger layout is refused before any group is built


def _prefix_product(a: list[int]) -> list[int]:
    out, acc = [1], 1
    for v in a:
        acc *= v
        out.append(acc)
    return out


def orthogonal_groups(world: int, sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """megatron-core's ``generate_masked_orthogonal_rank_groups``: the groups of the masked dimensions, each a list
    of global ranks, for dimensions of ``sizes`` laid out innermost first."""
    def decompose(index: int, shape: list[int]) -> list[int]:
        stride = _prefix_product(shape)
        return [(index // d) % s for s, d in zip(shape, stride)]

    masked = [s for s, m in zip(sizes, mask) if m]
    unmasked = [s for s, m in zip(sizes, mask) if not m]
    stride = _prefix_product(sizes)
    m_stride = [d for d, m in zip(stride, mask) if m]
    u_stride = [d for d, m in zip(stride, mask) if not m]
    size = _prefix_product(masked)[-1]
    groups = []
    for g in range(world // size):
        gi = decompose(g, unmasked)
        base = sum(x * y for x, y in zip(gi, u_stride))
        groups.append([base + sum(x * y for x, y in zip(decompose(r, masked), m_stride)) for r in range(size)])
    return groups


@dataclass(frozen=True)
class Layout:
    """A complete parallel layout: the dense grid and the expert grid over ``world`` ranks."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def dp(self) -> int:
        """The data-parallel size, world / (tp x pp x cp); 0 when that does not divide (one of ``problems()``)."""
        mp = self.tp * self.pp * self.cp
        return self.world // mp if mp and self.world % mp == 0 else 0

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    def problems(self, world_is: str = "", resize: str = "the world size") -> list[str]:
        """Megatron's divisibility rules, one line each with every factor and the fix (empty: the groups can be
        formed); the one statement of them. ``world_is`` says where the world size comes from (the preflight's
        " = nodes(2) * gpus_per_node(4)"), ``resize`` what to change instead of the parallelism."""
        out = []
        for name in ("world", "tp", "pp", "cp", "ep", "etp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                return [f"{name} ({v!r}) must be an integer >= 1"]
        if self.world > MAX_WORLD:
            return [f"world size {self.world} is more than {MAX_WORLD} ranks (tp {self.tp}, pp {self.pp}, cp "
                    f"{self.cp}, ep {self.ep}, etp {self.etp})"]
        mp = self.tp * self.pp * self.cp
        if self.world % mp:
            out.append(f"world size {self.world}{world_is} is not divisible by tp({self.tp}) * pp({self.pp}) * "
                       f"cp({self.cp}) = {mp}: change {resize} to a multiple of {mp}, or the parallelism")
        stage = self.world // self.pp if self.world % self.pp == 0 else None  # else: the line above says so
        if stage is not None and stage % (self.ep * self.etp):
            out.append(f"the {self.world // max(self.pp, 1)} rank(s) of a pipeline stage (world {self.world}"
                       f"{world_is} / pp {self.pp}) do not divide into expert groups of ep({self.ep}) * "
                       f"etp({self.etp}) = {self.ep * self.etp}: change ep, or {resize}")
        return out

    def as_record(self) -> dict[str, int]:
        """The layout as a run record writes it: every factor and dp."""
        return {"world": self.world, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "etp": self.etp,
                "dp": self.dp}

    @classmethod
    def from_record(cls, d: dict) -> Layout:
        """The layout of :meth:`as_record`'s dict (its dp is derived, so not read)."""
        return cls(**{k: d[k] for k in ("world", "tp", "pp", "cp", "ep", "etp") if k in d})

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group megatron-core forms for this layout (``tp``, ``cp``, ``dp``, ``pp`` of the dense grid;
        ``ep``, ``etp``, ``expert`` = etp x ep of the expert grid), as RankGenerator.get_ranks returns them."""
        if self.problems():
            raise ValueError(f"no groups for a layout megatron-core refuses: {'; '.join(self.problems())}")
        dense = [self.tp, self.cp, 1, self.dp, self.pp]  # order tp-cp-ep-dp-pp, ep = 1 in the dense generator
        expert = [self.etp, 1, self.ep, self.edp, self.pp]  # the same order, cp = 1, tp = etp

        def dims(sizes: list[int], names: str) -> list[list[int]]:
            order = ["tp", "cp", "ep", "dp", "pp"]
            return orthogonal_groups(self.world, sizes, [o in names.split("-") for o in order])

        return {"tp": dims(dense, "tp"), "cp": dims(dense, "cp"), "dp": dims(dense, "dp"), "pp": dims(dense, "pp"),
                "ep": dims(expert, "ep"), "etp": dims(expert, "tp"), "expert": dims(expert, "tp-ep")}

    def positions(self, ranks_per_node: int) -> list[dict[str, int]]:
        """Per global rank: its node, local rank and its index in each group (tp, cp, dp, pp, ep, etp ranks), the
        positions ``parallel_state.get_*_rank()`` returns on that rank."""
        out = [{"rank": r, "node": r // ranks_per_node, "local_rank": r % ranks_per_node}
               for r in range(self.world)]
        for name, groups in self.groups().items():
            if name == "expert":
                continue
            for g in groups:
                for i, r in enumerate(g):
                    out[r][name] = i
        return out


def node_local_problems(layout: Layout, ranks_per_node: int, where: str) -> list[str]:
    """The node-local rule: every TP, CP and expert (EP x ETP) group of ``layout`` lies inside one node of
    ``ranks_per_node`` GPUs. One line per kind of group that crosses nodes, naming its factors and a fix."""
    if ranks_per_node < 1 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in
                                 (layout.world, layout.tp, layout.pp, layout.cp, layout.ep, layout.etp)):
        return []
    formed = not layout.problems()  # else the groups cannot be formed: only the sizes are checked
    out = []
    named = {"tp": f"tp({layout.tp})", "cp": f"tp({layout.tp}) * cp({layout.cp})",
             "expert": f"ep({layout.ep}) * etp({layout.etp})"}
    traffic = {"tp": "tensor-parallel all-reduces", "cp": "context-parallel ring exchanges",
               "expert": "the expert all-to-all (~14x slower off NVLink, fabric hangs)"}
    span = {"tp": layout.tp, "cp": layout.tp * layout.cp, "expert": layout.ep * layout.etp}
    groups = layout.groups() if formed else {}
    for kind in ("tp", "cp", "expert"):
        if kind == "cp" and layout.cp == 1:
            continue
        bad = next((g for g in groups[kind] if len({r // ranks_per_node for r in g}) > 1), None) if formed else \
            ([0, span[kind] - 1] if span[kind] > ranks_per_node else None)  # only its size is known (and used)
        if bad is None:
            continue
        if span[kind] > ranks_per_node:
            hint = {"tp": f"keep tp <= {ranks_per_node}",
                    "cp": f"keep tp * cp <= {ranks_per_node}",
                    "expert": f"keep ep * etp <= {ranks_per_node} (e.g. ep={max(1, ranks_per_node // layout.etp)})"}
            out.append(f"{named[kind]} = {span[kind]} > gpus_per_node({ranks_per_node}) {where}: {traffic[kind]} "
                       f"would cross nodes; {hint[kind]}")
        else:
            nodes = sorted({r // ranks_per_node for r in bad})
            out.append(f"the {kind} group {bad} spans nodes {nodes} {where} ({ranks_per_node} GPUs per node): "
                       f"{traffic[kind]} would cross nodes; use sizes that divide {ranks_per_node}")
    return out


# What a GPU job holds per GPU beyond its tensors (CUDA context, NCCL buffers, allocator fragmentation): the
# training preflight's and the export/import plans' memory estimates add it.
OVERHEAD_GB = 5.0


def weight_gb_per_gpu(dense_params_b: float, expert_params_b: float, layout: Layout, bytes_per_param: int = 2
                      ) -> float:
    """One rank's share of the weights: the dense part split over tp x pp, the experts over etp x ep x pp."""
    dense = dense_params_b * 1e9 / (layout.tp * layout.pp)
    expert = expert_params_b * 1e9 / (layout.etp * layout.ep * layout.pp)
    return bytes_per_param * (dense + expert) / 1e9


# ---- the model's shape against the layout ------------------------------------------------------------------
# megatron-core 0.19.2's rules, each where it raises (every one on every rank, after the nodes are allocated):
#   tp divides num_attention_heads                           transformer/transformer_config.py __post_init__
#   tp is a multiple or a divisor of num_query_groups        the same (tp > KV heads replicates them on the TP ranks)
#   tp divides mamba_num_heads and mamba_num_groups          ssm/mamba_mixer.py MambaMixer.__init__
#   cp divides mamba_num_heads / tp; and mamba_num_groups/tp
#     is a multiple or a divisor of cp                       ssm/mamba_context_parallel.py
#   ep divides num_moe_experts                               transformer/moe/moe_layer.py MoELayer.__init__
#   pp divides the layers (a hybrid model: its layer pattern, models/hybrid/hybrid_layer_allocation.py
#     select_pipeline_segment; a transformer: transformer_block.get_num_layers_to_build), or, with
#     num_layers_in_first/last_pipeline_stage, the middle stages divide the middle layers (transformer_config.py)
#   training an MoE with tp > 1 needs sequence_parallel      transformer/moe/moe_layer.py MoELayer.forward


def tp_shape_problem(shape, tp: int, cp: int = 1) -> str | None:
    """Why megatron-core cannot split ``shape``'s attention (and Mamba) heads over ``tp`` ranks (with ``cp``), or
    None."""
    if shape.num_attention_heads % tp:
        return (f"tp({tp}) does not divide the {shape.num_attention_heads} attention heads of {{model}} "
                "(TransformerConfig)")
    kv = shape.num_query_groups
    if kv % tp and tp % kv:
        return (f"tp({tp}) is neither a divisor nor a multiple of the {kv} KV heads (num_query_groups) of {{model}} "
                "(TransformerConfig)")
    if shape.is_hybrid and shape.mamba_num_heads:
        if shape.mamba_num_heads % tp:
            return f"tp({tp}) does not divide the {shape.mamba_num_heads} Mamba heads of {{model}} (MambaMixer)"
        if shape.mamba_num_groups % tp:
            return (f"tp({tp}) does not divide the {shape.mamba_num_groups} Mamba groups (n_groups) of {{model}} "
                    "(MambaMixer)")
        if cp > 1:
            heads, groups = shape.mamba_num_heads // tp, shape.mamba_num_groups // tp
            if heads % cp:
                return (f"cp({cp}) does not divide the {heads} Mamba heads per TP rank ({shape.mamba_num_heads} / tp "
                        f"{tp}) of {{model}} (MambaContextParallel)")
            if groups % cp and cp % groups:
                return (f"cp({cp}) is neither a divisor nor a multiple of the {groups} Mamba groups per TP rank "
                        f"({shape.mamba_num_groups} / tp {tp}) of {{model}} (MambaContextParallel)")
    return None


def pp_shape_problem(shape, pp: int, first: int | None = None, last: int | None = None) -> str | None:
    """Why megatron-core cannot cut ``shape``'s layers into ``pp`` stages (with the optional uneven first/last stage
    layer counts), or None."""
    layers = shape.num_layers
    what = (f"the {layers}-layer hybrid pattern" if shape.is_hybrid else f"the {layers} layers") + " of {model}"
    rule = "select_pipeline_segment" if shape.is_hybrid else "get_num_layers_to_build"
    if first is None and last is None:
        if layers % pp:
            return f"pp({pp}) does not split {what} evenly ({layers} % {pp} = {layers % pp}; {rule})"
        return None
    for name, v in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if v is not None and v < 1:
            return f"{name}({v}) must be >= 1"
    middle = layers - (first or 0) - (last or 0)
    stages = pp - (first is not None) - (last is not None)
    if middle < 0 or bool(middle) != bool(stages > 0) or (stages > 0 and middle % stages):
        return (f"pp({pp}) with first stage {first} and last stage {last} layers leaves {middle} layers of {what} "
                f"for {max(stages, 0)} middle stage(s), which must divide them evenly ({rule})")
    return None


def _nearest(value: int, ok, top: int) -> list[int]:
    """The nearest values below and above ``value`` (within 1..top) for which ``ok`` holds."""
    below = next((v for v in range(min(value - 1, top), 0, -1) if ok(v)), None)  # bounded: --pp 1000000000
    above = next((v for v in range(value + 1, top + 1) if ok(v)), None)
    return [v for v in (below, above) if v is not None]


def _use(name: str, values: list[int]) -> str:
    return "use " + " or ".join(f"{name} {v}" for v in values) if values else f"no {name} fits"


def _shape_findings(spec, layout: Layout, sequence_parallel: bool | None, first: int | None, last: int | None
                    ) -> list[tuple[str, str, list[int]]]:
    """(problem line without its fix, the factor to change, its nearest valid values) per broken rule."""
    shape = getattr(spec, "shape", None)
    if shape is None or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                            for v in (layout.tp, layout.pp, layout.cp, layout.ep)):
        return []
    name = spec.name
    tp, pp, cp, ep = layout.tp, layout.pp, layout.cp, layout.ep
    out = []
    why = tp_shape_problem(shape, tp, cp)
    if why:
        if why.startswith("cp("):
            out.append((why.replace("{model}", name) + ": megatron-core raises on every rank", "cp",
                        _nearest(cp, lambda v: tp_shape_problem(shape, tp, v) is None, shape.mamba_num_heads)))
        else:
            out.append((why.replace("{model}", name) + ": megatron-core raises on every rank", "tp",
                        _nearest(tp, lambda v: tp_shape_problem(shape, v) is None, shape.num_attention_heads)))
    if shape.num_moe_experts and shape.num_moe_experts % ep:
        out.append((f"ep({ep}) does not divide the {shape.num_moe_experts} routed experts of {name} (MoELayer): "
                    "megatron-core raises on every rank", "ep",
                    _nearest(ep, lambda v: shape.num_moe_experts % v == 0, shape.num_moe_experts)))
    why = pp_shape_problem(shape, pp, first, last)
    if why:
        out.append((why.replace("{model}", name) + ": megatron-core raises on every rank", "pp",
                    _nearest(pp, lambda v: pp_shape_problem(shape, v) is None, shape.num_layers)))
    if sequence_parallel is False and shape.num_moe_experts and tp > 1:
        out.append((f"tp({tp}) > 1 without sequence parallelism: megatron-core's MoE layers of {name} refuse to "
                    "train (MoELayer.forward raises); set model.sequence_parallel=true (or tp 1)", "", []))
    return out


def model_shape_problems(spec, layout: Layout, *, sequence_parallel: bool | None = None,
                         first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> list[str]:
    """megatron-core's rules for ``spec``'s shape (config/models.py ModelShape) against ``layout``: one line per
    broken rule, naming the factors, the megatron-core function that raises and the nearest values that keep the
    rule (the other factors unchanged). ``sequence_parallel``: the layout trains (None: generation or conversion,
    where the MoE sequence-parallel rule does not apply). Empty for a model without a shape."""
    out = []
    for line, factor, values in _shape_findings(spec, layout, sequence_parallel, first_stage_layers,
                                                last_stage_layers):
        if factor:
            line += "; " + _use(factor, values)
            if factor == "pp" and (first_stage_layers is not None or last_stage_layers is not None):
                line += " with even stages"
        out.append(line)
    return out


def shape_fixes(spec, layout: Layout) -> list[Layout]:
    """Layouts near ``layout`` that keep megatron-core's shape rules: each broken factor replaced by one of its nearest
    valid values, nearest first (the smaller on a tie). The caller keeps the first its other checks accept."""
    findings = [(f, v) for _, f, v in _shape_findings(spec, layout, None, None, None) if f]
    if not findings:
        return []
    choices = [[(f, x) for x in sorted(vals, key=lambda x: (abs(x - getattr(layout, f)), x))] for f, vals in findings]
    out = []
    for combo in itertools.product(*choices):
        fields = dict(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp)
        fields.update(combo)
        out.append(fields)
    out.sort(key=lambda d: sum(abs(d[k] - getattr(layout, k)) for k in ("tp", "pp", "cp", "ep")))
    return [Layout(layout.world, **d) for d in out]
