"""The plan base: what every job of the suite is planned as before anything is queued, whatever it runs.

A job's plan says what it runs (``kind``, ``model``, ``engine``), where (the cluster profile, ``nodes`` x
``ranks_per_node`` ranks in a parallel ``layout``), what it needs (GB per GPU ``memory_gb`` against the profile's
``memory_budget_gb``), how it starts (the ranks' ``env`` and each node's ``launch`` line) and whether it can
(``problems``, one line each: the command exits 2 with them and ``isambard_sbatch`` refuses the submission), with
``notes`` for what the user should know. Training's plan (``training/preflight.Plan``) extends it; so do the
checkpoint side's (export, import, upload-all, coherence, evaluation).

One vocabulary for the facts every plan has (``ranks_per_node``, ``world``, ``memory_per_gpu_gb``,
``memory_phases``), and one ``as_dict``/``format`` pair a job overrides only to keep the record and the text its
users already read (training's ``preflight.json`` and dry run, the checkpoint side's ``--dry-run --json``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pipeline.common.errors import UserError
from pipeline.config.cluster import ClusterProfile
from pipeline.config.job_env import env_words
from pipeline.config.parallel import Layout


@dataclass(kw_only=True)
class BasePlan:
    """A planned job: the facts every job has (the module docstring)."""

    kind: str  # train, export, import, upload-all, coherence, evaluate (jobs/registry.py)
    model: str
    engine: str  # the word its record has always held: a training engine's name, or the checkpoint's format
    cluster: str  # the cluster profile's name
    nodes: int
    ranks_per_node: int
    layout: Layout
    memory_gb: dict[str, float] = field(default_factory=dict)  # GB per GPU (training: by part, with its total)
    memory_budget_gb: float = 0.0  # the profile's usable GB per GPU (0: no budget, nothing checked)
    env: dict[str, str] = field(default_factory=dict)  # what the launch sets for its ranks (config.job_env.job_env)
    launch: list[str] = field(default_factory=list)  # the command each node runs
    gpus_needed: int | None = None  # GPUs per node the job uses (None: one per rank; 0: none)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # known hazards: reported, not refused
    # not in any record: the profile itself (``cluster`` is its name) and the run a job writes (training's name)
    profile: ClusterProfile | None = field(default=None, repr=False, compare=False)
    run_name: str | None = None

    WORD: ClassVar[str] = "plan"  # what the submission's lines call it ("plan: 2 problem(s); nothing was submitted")

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def world(self) -> int:
        return self.layout.world

    def memory_phases(self) -> dict[str, float]:
        """GB per GPU of each phase the job runs one after the other (it needs the largest, not their sum)."""
        return dict(self.memory_gb)

    @property
    def memory_per_gpu_gb(self) -> float:
        return round(max(self.memory_phases().values(), default=0.0), 1)

    @property
    def gpus_per_node(self) -> int:
        return self.ranks_per_node if self.gpus_needed is None else self.gpus_needed

    def check_gpus_asked(self, asked: int, written: str) -> None:
        """A submission's GPUs per node (``written``: the option as the user gave it) against the plan's: fewer than
        the job uses is a problem of the plan (its launch line starts one rank per GPU it counted)."""
        if asked < self.gpus_per_node:
            self.problems.append(f"the {self.kind} plan ({self.engine}) uses {self.gpus_per_node} GPU(s) per node, "
                                 f"and {written} gives {asked}: submit with --gpus-per-node={self.gpus_per_node}"
                                 f" (the plan: {self.kind} ... --dry-run)")

    def refusal(self) -> UserError:
        """The submission's refusal of a plan with problems: one line each, then the count."""
        return UserError("\n".join(self.problems) + f"\n{self.WORD}: {len(self.problems)} problem(s); nothing was "
                         "submitted")

    def pass_line(self) -> str:
        """The submission's line for a plan that passed (isambard_sbatch prints it on stderr)."""
        memory = (f"memory estimate {self.memory_per_gpu_gb:.1f} GB per GPU" if self.memory_per_gpu_gb > 0 else
                  "memory not estimated (no size facts of the model yet: an export still to be written, or a model "
                  "the registry does not know; the job checks it when it starts)")
        lay = self.layout
        return (f"Plan: PASS - {self.kind}: world {self.world} on {self.nodes} node(s) (tp {lay.tp} pp {lay.pp} "
                f"ep {lay.ep}), {memory}")

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON: every fact above, the layout flat (world, tp, ..., dp), and its verdict."""
        return {"kind": self.kind, "model": self.model, "engine": self.engine, "cluster": self.cluster,
                "nodes": self.nodes, "ranks_per_node": self.ranks_per_node, **self.layout.as_record(),
                "memory_per_gpu_gb": self.memory_per_gpu_gb, "memory_gb": dict(self.memory_gb),
                "memory_budget_gb": self.memory_budget_gb, "gpus_per_node": self.gpus_per_node, "env": dict(self.env),
                "launch": list(self.launch), "ok": self.ok, "problems": list(self.problems), "notes": list(self.notes),
                "warnings": list(self.warnings)}

    def detail_lines(self) -> list[str]:
        """A job's own lines of :meth:`format`, after the memory line (none here)."""
        return []

    def format(self) -> str:
        """The plan as the dry run prints it: what, where, memory, launch, notes, problems, verdict."""
        lay = self.layout
        cp = f" cp {lay.cp}" if lay.cp != 1 else ""
        lines = [f"plan: {self.kind} of {self.model} ({self.engine}) on cluster profile '{self.cluster}'",
                 f"  world {self.world} = {self.nodes} node(s) x {self.ranks_per_node} process(es); tp {lay.tp} "
                 f"pp {lay.pp}{cp} ep {lay.ep} etp {lay.etp} dp {lay.dp}"]
        phases = self.memory_phases()
        if phases:
            budget = f" of {self.memory_budget_gb:g} GB" if self.memory_budget_gb else ""
            lines.append(f"  memory per GPU: {self.memory_per_gpu_gb:.1f} GB{budget} (phases: "
                         + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) + ")")
        lines += self.detail_lines()
        if self.launch:
            lines.append("  launch (each node): " + " ".join([*env_words(self.env), shlex.join(self.launch)]))
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  problem: {p}" for p in self.problems]
        lines.append("verdict: " + ("OK" if self.ok else f"REFUSED ({len(self.problems)} problem(s))"))
        return "\n".join(lines)
