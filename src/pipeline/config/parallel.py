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
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    def problems(self) -> list[str]:
        """Megatron's divisibility rules, one line each (empty: the groups can be formed)."""
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
            out.append(f"world size {self.world} is not divisible by tp({self.tp}) * pp({self.pp}) * cp({self.cp}) "
                       f"= {mp}")
        stage = self.world // self.pp if self.world % self.pp == 0 else None
        if stage is None or stage % (self.ep * self.etp):
            out.append(f"the {self.world // max(self.pp, 1)} rank(s) of a pipeline stage (world {self.world} / "
                       f"pp {self.pp}) do not divide into expert groups of ep({self.ep}) * etp({self.etp}) = "
                       f"{self.ep * self.etp}")
        return out

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group megatron-core forms for this layout (``tp``, ``cp``, ``dp``, ``pp`` of the dense grid;
        ``ep``, ``etp``, ``expert`` = etp x ep of the expert grid), as RankGenerator.get_ranks returns them."""
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


def weight_gb_per_gpu(dense_params_b: float, expert_params_b: float, layout: Layout, bytes_per_param: int = 2
                      ) -> float:
    """One rank's share of the weights: the dense part split over tp x pp, the experts over etp x ep x pp."""
    dense = dense_params_b * 1e9 / (layout.tp * layout.pp)
    expert = expert_params_b * 1e9 / (layout.etp * layout.ep * layout.pp)
    return bytes_per_param * (dense + expert) / 1e9
