"""The Megatron checkpoint layout, shared by both engines (the only module that reads or writes it).

    <save>/iter_0000200/                     one directory per saved iteration
    <save>/latest_checkpointed_iteration.txt the latest *complete* iteration, written last (atomically)

A local-engine iteration directory is a Hugging Face checkpoint plus the Trainer's optimizer/scheduler/RNG
state and ``pipeline_checkpoint.json`` (engine, model, iteration), written before the directory is moved
into place. A Megatron (Bridge) iteration directory is a ``torch_dist`` checkpoint (``metadata.json``,
``common.pt``, shards). An iteration counts as complete when the tracker names it or a later iteration,
and its directory holds its engine's completion files - never a directory still being written.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import struct
from pathlib import Path

from pipeline.common.errors import UserError
from pipeline.common.io import apply_umask_modes, read_json, read_regular, write_json, write_text

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "pipeline_checkpoint.json"
# Written by the training engines (through training/records.py) beside <save> and in the run directory when
# training has finished: the convert-every-checkpoint poller stops on it.
TRAINING_DONE = "TRAINING_DONE"
_ITER_RE = re.compile(r"^iter_(\d{7})$")
# The training that owns a checkpoint.save (training/records.py claim_save) records itself here, its run directory
# named: the save's readers (upload-all's poller) find the run's records through it.
OWNER_FILE = ".pipeline_owner.json"
OWNER_LOCK = ".pipeline_owner.lock"  # held while the owner record is checked and written (claim_save)
# upload-all's markers beside the iterations (checkpoint/poll.py): one per converted iteration, one per evaluation
DONE_DIR = "converted_checkpoints"
EVAL_DIR = "evaluated_checkpoints"


def iteration_of(path: Path | str) -> int | None:
    """The iteration an ``iter_NNNNNNN`` folder name stands for; None for any other name. The one parser of
    iteration folder names: every other module asks this one (tests/unit/test_layout.py greps for others)."""
    m = _ITER_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def iteration_number(path: Path | str) -> int:
    """The iteration of a path already known to be an iteration folder (a ValueError otherwise: a caller's bug,
    never a user's input, which :func:`resolve_iteration` and :func:`iteration_of` check)."""
    it = iteration_of(path)
    if it is None:
        raise ValueError(f"{path} is not an iteration folder (iter_NNNNNNN)")
    return it


def is_iteration_dir(path: Path | str) -> bool:
    """Whether ``path``'s name is an iteration folder's (``iter_NNNNNNN``); it need not exist."""
    return iteration_of(path) is not None


def export_iteration(path: Path | str) -> int | None:
    """The iteration of an iteration folder or of its Hugging Face export (``iter_NNNNNNN/hf``, a link to one
    resolved); None for any other model."""
    p = Path(path)
    return iteration_of(p.resolve().parent if p.name == "hf" else p)


def holds_iterations(save: Path) -> bool:
    """Whether ``save`` looks like a checkpoint folder already: a tracker, or any entry named like an iteration (the
    loose pattern, ``iter_`` and a digit, so a hand-made or foreign-width one counts too)."""
    return (Path(save) / TRACKER).exists() or any(Path(save).glob("iter_[0-9]*"))


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iter_dir(save: Path, iteration: int) -> Path:
    return Path(save) / iter_dirname(iteration)


def read_tracker(save: Path) -> int | None:
    p = Path(save) / TRACKER
    if not p.exists():
        return None
    try:  # a regular file of a few bytes: a FIFO there would block `runs` and upload-all for ever
        text = read_regular(p, 4096)[:64].decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        raise UserError(f"{p} is unreadable or not text (or not a regular file): it should hold one iteration "
                        "number") from None
    if text == "release":
        return 0
    if not text.isascii() or not text.isdigit():
        raise UserError(f"{p} holds {text[:20]!r}, not an iteration number: fix or remove it")
    return int(text)


def write_tracker(save: Path, iteration: int) -> None:
    write_text(Path(save) / TRACKER, f"{iteration}\n")


def publish_iteration(staged: Path, save: Path, iteration: int, marker: dict) -> Path:
    """Publish a fully written checkpoint directory as ``<save>/iter_NNNNNNN``: the marker inside, file modes
    from the umask (safetensors writes 0600; the team must read checkpoints), one rename, then the tracker (last,
    so a reader that trusts the tracker never sees a half-published iteration)."""
    write_json(staged / MARKER, {**marker, "files": written_names(staged)})
    target = iter_dir(save, iteration)
    if target.exists():
        shutil.rmtree(target)
    apply_umask_modes(staged)
    os.replace(staged, target)
    write_tracker(save, iteration)
    return target


def written_names(staged: Path) -> list[str]:
    """The top-level names of a checkpoint as written (the marker records them: what --force may replace)."""
    return sorted(p.name for p in Path(staged).iterdir() if p.name != MARKER)


# what comes into a published iteration after it was written: its export (hf/) and the export's temporaries
_ADDED_LATER = re.compile(r"^(hf|\.hf\..*\.tmp|hf_verification_FAILED\.json)$")
# what Megatron (Bridge's save and import) writes into a torch_dist iteration, as seen in the megatron_cpu tier's
# checkpoints; anything else in one is a user's (import --force over it must not delete their notes)
MEGATRON_ENTRIES = ("*.distcp", ".metadata", "common.pt", "metadata.json", "run_config.yaml", "train_state.pt",
                    "modelopt_state", "modelopt_run_config.yaml", "content_metadata.json", "tokenizer")


def _megatron_entry(name: str) -> bool:
    return bool(_ADDED_LATER.match(name)) or any(fnmatch.fnmatch(name, g) for g in MEGATRON_ENTRIES)


def unlisted_entries(d: Path) -> list[str]:
    """What an iteration of ours holds beyond what its marker says it was written with, its export aside (a user's
    notes inside iter_0000000 must not be deleted by import --force). Empty for a marker that lists no
    files (written before markers did) and for Megatron's iterations, which carry no marker."""
    try:
        marker = read_json(d / MARKER)
    except (OSError, ValueError):
        return []
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, list):
        return []
    listed = {str(f) for f in files} | {MARKER}
    return [p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in sorted(d.iterdir())
            if p.name not in listed and not _ADDED_LATER.match(p.name)]


def engine_of(d: Path) -> str | None:
    if (d / MARKER).exists():
        try:
            marker = read_json(d / MARKER)
        except (OSError, ValueError):
            raise UserError(f"{d / MARKER} is not valid JSON: the checkpoint's marker is corrupt") from None
        return marker.get("engine", "local") if isinstance(marker, dict) else None
    # torch_dist: Megatron's metadata.json, and common.pt (a training save) or DCP's .metadata / Bridge's
    # run_config.yaml (Bridge's import writes no common.pt: found by the megatron_cpu tier)
    if (d / "metadata.json").exists() and any((d / f).exists() for f in ("common.pt", ".metadata", "run_config.yaml")):
        return "megatron"
    return None


def is_complete_dir(d: Path) -> bool:
    """The engine's own completion files are present (a directory mid-save fails this)."""
    eng = engine_of(d)
    if eng == "local":
        weights = list(d.glob("*.safetensors"))
        return (d / "config.json").exists() and bool(weights) and all(safetensors_complete(f) for f in weights)
    if eng == "megatron":  # torch_dist: the shards (*.distcp) or DCP's final .metadata exist
        return (d / ".metadata").exists() or any(d.glob("*.distcp"))
    return False


def safetensors_complete(path: Path) -> bool:
    """The file is a whole safetensors file: its JSON header parses and the file is exactly as long as the header
    says (a truncated copy or a save cut short fails this)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                return False
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return path.stat().st_size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def result_markers(ckpt: Path, it: int) -> list[Path]:
    """The markers that stand for an iteration's export and the results inside its ``hf/`` (conversion, coherence
    recorded in the conversion's marker, ``hf/eval/`` per task list): what a new ``hf/`` makes untrue."""
    name = iter_dirname(it)
    return sorted([*(Path(ckpt) / DONE_DIR).glob(f"{name}.*"), *(Path(ckpt) / EVAL_DIR).glob(f"{name}.*")])


def list_iterations(save: Path) -> list[int]:
    save = Path(save)
    if not save.is_dir():
        return []
    out = []
    for d in save.iterdir():
        m = _ITER_RE.match(d.name)
        if m and d.is_dir():
            out.append(int(m.group(1)))
    return sorted(out)


def complete_iterations(save: Path) -> list[int]:
    """Iterations that are safe to read: at or below the tracker, with complete directories."""
    latest = read_tracker(save)
    if latest is None:
        return []
    return [i for i in list_iterations(save) if i <= latest and is_complete_dir(iter_dir(save, i))]


def latest_complete(save: Path) -> int | None:
    its = complete_iterations(save)
    return its[-1] if its else None


def resolve_iteration(save: Path, iteration: int | None) -> Path:
    """The directory to export: the requested iteration, or the latest complete one. UserError otherwise."""
    save = Path(save)
    if not save.is_dir():
        raise UserError(f"checkpoint directory {save} does not exist")
    complete = complete_iterations(save)
    if iteration is None:
        if not complete:
            raise UserError(f"no complete checkpoint in {save} (no {TRACKER}, or it names no complete iteration)")
        tracked = read_tracker(save)
        if tracked is not None and tracked not in complete and tracked in list_iterations(save):
            raise UserError(f"{TRACKER} names iteration {tracked}, but {iter_dirname(tracked)} is incomplete; "
                            f"complete iterations: {', '.join(map(str, complete))}; pass --iteration N")
        if tracked is not None and tracked not in complete:
            raise UserError(f"{TRACKER} names iteration {tracked}, but {iter_dirname(tracked)} does not exist; "
                            f"complete iterations: {', '.join(map(str, complete))}; pass --iteration N")
        return iter_dir(save, complete[-1])
    if iteration not in complete:
        have = ", ".join(str(i) for i in complete) or "none"
        if iteration in list_iterations(save):
            raise UserError(f"iteration {iteration} in {save} is incomplete (still being written or interrupted); "
                            f"complete iterations: {have}")
        raise UserError(f"iteration {iteration} does not exist in {save}; complete iterations: {have}")
    return iter_dir(save, iteration)


# ---- the one output-folder rule: before any job writes or deletes a checkpoint folder --------------------------
# What a checkpoint folder of this suite holds beside its iter_NNNNNNN folders: the trackers (ours, Bridge's), the
# completion marker, the owner record and its lock (training/records.py), upload-all's marker and lock folders
# (poll.py, lock.py), Megatron's progress log and Bridge's non-persistent saves.
OWN_ENTRIES = frozenset({TRACKER, "latest_train_state.pt", "progress.txt", TRAINING_DONE, OWNER_FILE, OWNER_LOCK,
                         "converted_checkpoints", "evaluated_checkpoints", "in_progress_checkpoints", "non_persistent"})


OWN_FOLDERS = {DONE_DIR: r"iter_\d{7}\.(done|failed)",
               EVAL_DIR: r"iter_\d{7}\..+\.(done|failed)",
               "in_progress_checkpoints": r"iter_\d{7}\.lock(\.\d+\.stale)?",
               "non_persistent": r"iter_\d{7}|latest_checkpointed_iteration\.txt"}
# an atomic write's temporary (common/io.py's names) and an import's staging folder
_OUR_TEMPORARY = re.compile(r"\..+\.[A-Za-z0-9_-]{1,64}~[0-9]{1,10}~[a-z0-9]{1,16}\.tmp|\..+\.importing")


def _foreign_in_own(d: Path) -> list[str]:
    pattern = re.compile(OWN_FOLDERS[d.name])
    return [p.name for p in sorted(d.iterdir()) if not (pattern.fullmatch(p.name) or _OUR_TEMPORARY.fullmatch(p.name))]


def foreign_entries(folder: Path) -> list[str]:
    """What in ``folder`` is not part of a checkpoint this suite wrote (names relative to it, sorted): anything but
    :data:`OWN_ENTRIES`, an atomic write's temporary (``.NAME....tmp``) and iter_NNNNNNN folders that are empty or
    hold a checkpoint (its marker, or Megatron's torch_dist files)."""
    out = []
    for e in sorted(Path(folder).iterdir()):
        if e.name in OWN_FOLDERS and e.is_dir() and not e.is_symlink():
            # the suite's own folders hold its markers, locks and Megatron's non-persistent saves, nothing else (a
            # Megatron import --force removes the output whole)
            out += [f"{e.name}/{n}" for n in _foreign_in_own(e)]
            continue
        if e.name in OWN_ENTRIES or _OUR_TEMPORARY.fullmatch(e.name):
            continue
        if _ITER_RE.match(e.name) and e.is_dir() and not e.is_symlink():
            inside = sorted(e.iterdir())
            if not inside:
                continue
            engine = engine_of(e)
            if engine == "megatron" and not (e / MARKER).exists():
                out += [f"{e.name}/{f.name}" for f in inside if not _megatron_entry(f.name)]
                continue
            if engine is not None:
                out += [f"{e.name}/{n}" for n in unlisted_entries(e)]
                continue
            out += [f"{e.name}/{f.name}" for f in inside]
            continue
        out.append(e.name + ("/" if e.is_dir() else ""))
    return out


def output_folder_problem(folder: Path, *, force: bool, what: str = "the output") -> str | None:
    """The one rule before a job writes (or replaces) a checkpoint folder: None when it may, else the one-line
    refusal. Allowed: absent, an empty folder, or one this suite wrote (a tracker or iter_NNNNNNN checkpoints and
    nothing foreign: :func:`foreign_entries`) with ``force``. Never, even with ``force``: a file, or a folder holding
    anything else (a user's files, the shared models folder): --force replaces a checkpoint, it never deletes what
    is not one."""
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        return None
    if not folder.is_dir():
        return f"{what} {folder} exists and is not a folder: choose a new or empty folder"
    try:
        if not any(folder.iterdir()):
            return None
        foreign = foreign_entries(folder)
    except OSError as exc:
        return f"{what} {folder} cannot be read ({exc.strerror or exc}): choose a new or empty folder"
    if not foreign and not any((folder / n).exists() for n in (TRACKER, "latest_train_state.pt")) and \
            not list_iterations(folder):
        return None  # only markers or temporaries: no checkpoint to lose
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return (f"{what} {folder} holds files that are not a checkpoint ({shown}): refusing to write or delete it, "
                "even with --force; choose a new or empty folder")
    if not force:
        return f"{folder} already holds a checkpoint; --force to overwrite"
    return None


def check_output_folder(folder: Path, *, force: bool, what: str = "the output") -> None:
    """:func:`output_folder_problem` as a UserError (exit 2, one line)."""
    problem = output_folder_problem(folder, force=force, what=what)
    if problem:
        raise UserError(problem)
