"""Two pytest workers (pytest-xdist; tests/run.sh runs ``pytest -n 2``), and which tests may run at once.

The slurm tier mostly waits on its jobs while the rest of the suite mostly computes, so one worker runs the
**serial group** while the other takes the rest, and both share what is left once the serial group is done.
A group is one work unit: one worker runs its tests one after another, in collection order.

- ``serial``: every test of the slurm tier (tests/tiers.py): the one local cluster (four nodes) runs one test's
  jobs at a time, as it did before workers (two tests' jobs at once could queue each other past a test's wait, and
  several tests need nodes idle or a job running at once); and every test that shares a fixture built once
  (module- or session-scoped, defined under tests/, other than CHEAP) with one of them, so that fixture is still
  built once: the megatron_cpu tier's session-scoped tiny model is used by its 2-node case on the cluster, so
  the whole tier joins.
- any other test: its module's group, so that a module-scoped fixture (the twin, the Bridge harness, the
  Charliecloud image, a trained checkpoint) is built once, as without workers.

The controller sends the serial group first, then the other groups largest first (those of a tier, then those
with ``slow`` tests, then by their number of tests), so the last units are the short ones. The controller does
not collect: each worker writes its collection's groups to a file the controller named (``pytest_configure_node``),
before it reports its collection, and the scheduler reads them when every worker has collected. Test ids are
pytest's own (xdist's ``loadgroup`` would append ``@group`` to each).

What else the workers share is safe at once: the machine caches (tests/machine_cache.sh) build under a flock and
link atomically, the env setup's steps are done once (a second run skips them), and every port is a free one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.tiers import TIERS

SERIAL = "serial"
SERIAL_TIERS = ("slurm",)
CHEAP = {"slurm", "smollm2_dir", "tokenizer"}  # shared fixtures cheap enough to set up on each worker
TESTS_DIR = Path(__file__).resolve().parent
DIST_MODES = ("load", "loadscope", "loadfile", "loadgroup")  # what the suite's scheduler replaces
_GROUPS_KEY = "pipeline_groups_dir"


def _tiers(item) -> set[str]:
    return {t for t in TIERS if item.get_closest_marker(t) is not None}


def _shared_fixtures(item) -> set[tuple[str, str]]:
    """The fixtures built once for many tests (module, package or session scope) defined under tests/ that this
    test uses, by (where it is defined, name)."""
    info = getattr(item, "_fixtureinfo", None)
    out = set()
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        fd = defs[-1]
        if name in CHEAP or fd.scope == "function":
            continue
        func = getattr(fd, "func", None)
        code = getattr(func, "__code__", None)
        if code is None or not Path(code.co_filename).resolve().is_relative_to(TESTS_DIR):
            continue
        out.add((code.co_filename, name))
    return out


def groups(items) -> dict[str, str]:
    """Each test's group: ``serial`` or its module's path (see the module's docstring)."""
    serial = {i for i, item in enumerate(items) if _tiers(item) & set(SERIAL_TIERS)}
    shared = [_shared_fixtures(item) for item in items]
    pulled: set[tuple[str, str]] = set()
    while True:  # a test sharing a fixture built once with a serial test joins the group, until nothing changes
        pulled = set().union(*(shared[i] for i in serial)) if serial else set()
        more = {i for i, s in enumerate(shared) if i not in serial and s & pulled}
        if not more:
            break
        serial |= more
    return {item.nodeid: SERIAL if i in serial else item.nodeid.split("::", 1)[0] for i, item in enumerate(items)}


def _rank(item) -> int:
    if _tiers(item):
        return 2
    return 1 if item.get_closest_marker("slow") is not None else 0


def _is_controller(config) -> bool:
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") in DIST_MODES \
        and bool(getattr(config.option, "tx", None))


def configure(config):
    """tests/conftest.py's pytest_configure calls this (xdist has set dist and tx by then)."""
    if _is_controller(config):
        config._pipeline_groups_dir = tempfile.mkdtemp(prefix="pytest-groups.")


def pytest_unconfigure(config):
    path = getattr(config, "_pipeline_groups_dir", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    path = getattr(node.config, "_pipeline_groups_dir", None)
    if path:
        node.workerinput[_GROUPS_KEY] = path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    """On a worker, before xdist reports the collection: write each test's group and each group's rank."""
    workerinput = getattr(session.config, "workerinput", None)
    if not workerinput or _GROUPS_KEY not in workerinput:
        return
    of = groups(session.items)
    rank: dict[str, int] = {}
    for item in session.items:
        g = of[item.nodeid]
        rank[g] = 3 if g == SERIAL else max(rank.get(g, 0), _rank(item))
    out = Path(workerinput[_GROUPS_KEY]) / f"{workerinput['workerid']}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"groups": of, "rank": rank}))
    os.replace(tmp, out)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if not _is_controller(config):
        return None
    from xdist.scheduler.loadscope import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's LoadScopeScheduling with the suite's groups as the scopes, the serial group sent first."""

        groups: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            return self.groups.get(nodeid) or nodeid.split("::", 1)[0]

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            written = sorted(Path(config._pipeline_groups_dir).glob("*.json"))
            if not written:  # never run the slurm tier's tests side by side for want of their groups
                raise RuntimeError(f"no worker wrote its tests' groups to {config._pipeline_groups_dir}")
            data = json.loads(written[0].read_text())
            self.groups, rank = data["groups"], data["rank"]
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            for scope in sorted(units, key=lambda s: (-rank.get(s, 0), -len(units[s]))):
                self.workqueue[scope] = units[scope]
            for _ in range(len(self.nodes) - len(self.workqueue)):  # more workers than work
                unused, _assigned = self.assigned_work.popitem()
                unused.shutdown()
            for node in self.nodes:
                self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)
            if not self.workqueue:
                for node in self.nodes:
                    node.shutdown()

    return GroupScheduling(config, log)
