"""The docs a newcomer reads (issue 37): a short README with the two commands, topic docs beside it whose links
resolve, a file tree by directory that lists what is there, and decision numbers that name real entries."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from tests.helpers import ROOT

DOCS = ROOT / "docs"
TOPICS = ["cluster.md", "data.md", "training.md", "checkpoint.md", "coherence-and-evaluation.md", "experiments.md",
          "testing.md", "files.md", "profiling.md"]


def _markdown() -> dict[Path, str]:
    return {p: p.read_text() for p in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]}


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_short_and_has_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 15_000, f"README.md is {len(readme.encode())} bytes; the topic docs hold the rest"
    block = re.search(r"^## On a fresh machine: two commands\n\n```bash\n(.*?)```", readme, re.M | re.S)
    assert block, "README.md has no two-command block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["bash pipeline_quickstart.sh", "bash tests/run.sh"], commands
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("exec bash tests/run.sh")
    for topic in TOPICS:  # where to read on: every topic doc, linked from the README
        assert (DOCS / topic).is_file(), topic
        assert f"(docs/{topic})" in readme, f"README.md does not link docs/{topic}"


def test_every_link_and_docs_path_in_the_docs_resolves():
    problems = []
    for path, text in _markdown().items():
        # a Markdown link is relative to its file; a `docs/NAME.md` in code quotes to the repository root
        targets = [(path.parent, t) for t in re.findall(r"\]\(([^)\s]+)\)", text)]
        targets += [(ROOT, t) for t in re.findall(r"`(docs/[\w./-]+\.md)`", text)]
        for base, target in targets:
            if re.match(r"[a-z]+:", target):
                continue  # a web address: not checked offline
            file_part, _, anchor = target.partition("#")
            dest = (base / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{path.relative_to(ROOT)}: {target} does not exist")
            elif anchor and dest.suffix == ".md":
                anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                if anchor not in anchors:
                    problems.append(f"{path.relative_to(ROOT)}: {target}: no heading #{anchor}")
    assert not problems, "\n".join(problems)


def _listed() -> list[str]:
    tree = re.search(r"```\n(.*?)```", (DOCS / "files.md").read_text(), re.S)
    assert tree, "docs/files.md has no file tree"
    return [line.split()[0] for line in tree.group(1).splitlines() if line.strip()]


def test_the_file_tree_lists_what_is_there_by_directory():
    listed = _listed()
    missing = [p for p in listed if "*" not in p and not (ROOT / p).exists()]
    assert not missing, f"docs/files.md lists files that do not exist: {missing}"
    # by directory: each top-level folder is one block (the root's files first), not the order files were added
    tops = [p.split("/")[0] if "/" in p.rstrip("/") and not p.startswith(".") else "" for p in listed]
    blocks = [t for i, t in enumerate(tops) if i == 0 or t != tops[i - 1]]
    assert len(blocks) == len(set(blocks)) and blocks[0] == "", f"docs/files.md is not grouped by directory: {blocks}"
    # every entry point, source file, config, benchmark and doc has a line (itself, its folder or a pattern)
    wanted = [*ROOT.glob("pipeline_*"), ROOT / "isambard_sbatch", *(ROOT / "src").rglob("*.py"),
              *(ROOT / "src").rglob("*.sh"), *(ROOT / "src").rglob("*.json"), *(ROOT / "configs").rglob("*.yaml"),
              *(ROOT / "bench").glob("*.py"), *DOCS.glob("*.md"), *(ROOT / "tests").glob("*/test_*.py")]
    unlisted = []
    for f in wanted:
        rel = f.relative_to(ROOT).as_posix()
        if "__pycache__" in rel or (f.name == "__init__.py" and rel != "src/pipeline/__init__.py"):
            continue
        if not any(rel == p or (p.endswith("/") and rel.startswith(p)) or fnmatch.fnmatch(rel, p) for p in listed):
            unlisted.append(rel)
    assert not unlisted, f"docs/files.md has no line for: {unlisted}"


def test_every_decision_number_cited_names_an_entry():
    entries = set(re.findall(r"^## (\d+)\. ", (DOCS / "decisions.md").read_text(), re.M))
    cite = re.compile(r"[Dd]ecisions?(?:\.md)? ?#?(\d+)((?:(?:,| and) #?\d+)*)")
    sources = [*ROOT.glob("pipeline_*"), ROOT / "isambard_sbatch", ROOT / "README.md", *DOCS.glob("*.md"),
               *(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.sh"), *(ROOT / "configs").rglob("*.yaml"),
               *(ROOT / "bench").glob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "tests").rglob("*.sh")]
    unknown = []
    for f in sources:
        if "__pycache__" in f.parts or not f.is_file():
            continue
        for m in cite.finditer(f.read_text(errors="replace")):
            for n in [m.group(1), *re.findall(r"\d+", m.group(2))]:
                if n not in entries:
                    unknown.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    assert not unknown, f"decision numbers with no entry in docs/decisions.md: {unknown}"


def test_the_env_jobs_help_counts_the_checks_validate_runs():
    """Issue 59's docs drift: pipeline_env_submit.sbatch --help said 28 checks (30 with --run-training) while
    validate ran 30 (33): the counts in the header are the code's, and it names each check --run-training adds."""
    from pipeline.env.validate import CHECKS, TRAINING_CHECKS

    header = (ROOT / "pipeline_env_submit.sbatch").read_text()
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
    base, extra = len(CHECKS), len(TRAINING_CHECKS)
    assert f"validate runs {base} checks; --run-training adds {words[extra]} ({base + extra})" in header
    for check in TRAINING_CHECKS:
        assert f" {check.name}," in header, check.name
    assert f"{base} checks" in (ROOT / "README.md").read_text()


def test_pointers_to_readme_sections_name_sections_that_exist():
    """A help text that sends the reader to the README's "X" section (pipeline_experiment.py --help pointed to an
    "Experiments" section the README never had): every such pointer names a heading of the README."""
    headings = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", (ROOT / "README.md").read_text(), re.M)}
    files = [*ROOT.glob("*.py"), *ROOT.glob("*.sh"), *ROOT.glob("*.sbatch"), ROOT / "isambard_sbatch",
             *(ROOT / "src").rglob("*.py"), *(ROOT / "docs").glob("*.md")]
    cited = [(f.name, m.group(1)) for f in files for m in re.finditer(r"README(?:\.md)?'s [\"`“]([^\"`”]+)[\"`”]",
                                                                        f.read_text())]
    assert [c for c in cited if c[1] not in headings] == []


def test_documented_shared_checkpoint_folders_carry_the_user():
    """A team shares /projects/.../checkpoints/megatron: every save into it that the docs, the configs or a help text
    show carries the member ($USER or ${oc.env:USER}), as the smoke config does (issue 59: the documented demo's
    checkpoint.save did not, so two members' demos would write one run directory)."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").rglob("*.yaml"),
             *ROOT.glob("*.sh"), *ROOT.glob("*.sbatch"), *(ROOT / "src").rglob("*.py")]
    shared = re.compile(r"/projects/a5k/public/checkpoints/megatron/(\S+)")
    bare = [(f.name, m.group(0)) for f in files for m in shared.finditer(f.read_text())
            if not m.group(1).startswith(("$USER", "${oc.env:USER}", "<user>", "${USER}"))]
    assert bare == []
