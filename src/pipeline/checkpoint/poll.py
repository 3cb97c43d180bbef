"""``upload-all``: convert every complete iteration of a checkpoint directory exactly once, optionally
polling while training runs (the AutoExperiment seed's marker/lock scheme).

    <ckpt>/converted_checkpoints/iter_NNNNNNN.done     written (atomically) after a verified export
    <ckpt>/converted_checkpoints/iter_NNNNNNN.failed   verification failed: not retried automatically
    <ckpt>/in_progress_checkpoints/iter_NNNNNNN.lock   held while converting or evaluating (pid, host, time)
    <ckpt>/evaluated_checkpoints/iter_NNNNNNN.<tasks>.done     with ``--eval TASKS``: written after the results
    <ckpt>/evaluated_checkpoints/iter_NNNNNNN.<tasks>.failed   the evaluation failed: not retried automatically

An export that publishes a new ``hf/`` (``export --force``) removes the iteration's markers first
(``layout.result_markers``): the results they stood for (``hf/eval/``, ``hf/coherence/``) went with the old
``hf/``, so the next pass evaluates the new one instead of reporting success for results that are gone.

With an ``evaluate`` callable every converted iteration is also evaluated once, under the same lock and after its
export verified (an iteration converted before ``--eval`` was asked for is evaluated by the next pass); a killed
evaluation leaves its lock and no marker, so it is redone like a killed conversion.

Only iterations the tracker names as complete are touched, so a checkpoint still being written is never
read. A poller killed mid-conversion leaves a lock whose process is gone: the next poller on the same host
takes it over at once (another host after ``lock_ttl`` seconds); the export itself is idempotent (a
verified ``hf/`` is not redone), so nothing is converted twice and nothing is skipped. Polling stops once
training has finished (``TRAINING_DONE`` beside or inside the checkpoint directory) and every complete
iteration is converted, or after ``idle_timeout`` seconds without a new checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.checkpoint.lock import Lock, iteration_lock_path
from pipeline.common import layout
from pipeline.common.io import read_json, read_regular, write_json
from pipeline.common.log import progress_interval

log = logging.getLogger(__name__)
DONE_DIR, EVAL_DIR = layout.DONE_DIR, layout.EVAL_DIR
TRAINING_DONE = layout.TRAINING_DONE


def training_finished(ckpt: Path) -> bool:
    return (ckpt / TRAINING_DONE).exists() or (ckpt.parent / TRAINING_DONE).exists()


FAILED_PREFIX = "FAILED_"  # the training's failure records (FAILED_NAN): restarts refuse to run after one


def training_failed(ckpt: Path) -> Path | None:
    """A failure record of the training writing ``ckpt`` (``FAILED_*`` in its run directory, named by the save's
    owner record, or beside the checkpoints), or None: the training will write no further checkpoint."""
    places = [ckpt, ckpt.parent]
    try:
        owner = read_json(ckpt / layout.OWNER_FILE)  # a regular file only: a FIFO there blocked the poller
        if isinstance(owner, dict) and owner.get("run_dir"):
            places.insert(0, Path(str(owner["run_dir"])))
    except (OSError, ValueError):
        pass
    for place in places:
        try:
            found = sorted(p for p in place.iterdir() if p.name.startswith(FAILED_PREFIX) and p.is_file())
        except OSError:
            continue
        if found:
            return found[0]
    return None


def eval_marker(ckpt: Path, it: int, key: str, state: str) -> Path:
    return ckpt / EVAL_DIR / f"{layout.iter_dirname(it)}.{key}.{state}"


def convert_pending(ckpt: Path, convert: Callable[[Path], dict], lock_ttl: float = 3600,
                    evaluate: Callable[[Path], dict] | None = None, eval_key: str = "eval",
                    exported: Callable[[Path], bool] | None = None,
                    evaluated: Callable[[Path], bool] | None = None) -> tuple[list[int], list[int]]:
    """One pass: convert every complete, unconverted, unlocked iteration (and evaluate every converted one not
    evaluated yet, with ``evaluate``). Returns (converted, failed); a failed evaluation counts as failed.
    ``exported(iter_path)``: whether the iteration's export is there; a ``.done`` marker whose export is gone is
    not trusted (the iteration is converted again)."""
    done_dir = ckpt / DONE_DIR
    converted, failed = [], []
    for it in layout.complete_iterations(ckpt):
        name = layout.iter_dirname(it)
        if (done_dir / f"{name}.failed").exists():
            continue
        need_convert = not (done_dir / f"{name}.done").exists()
        if not need_convert and exported is not None and not exported(layout.iter_dir(ckpt, it)):
            log.warning("%s is marked converted (%s), but its export is gone: converting it again", name,
                        done_dir / f"{name}.done")
            need_convert = True
        need_eval = evaluate is not None and not any(eval_marker(ckpt, it, eval_key, s).exists()
                                                     for s in ("done", "failed"))
        if (evaluate is not None and not need_eval and evaluated is not None and
                eval_marker(ckpt, it, eval_key, "done").exists() and not evaluated(layout.iter_dir(ckpt, it))):
            log.warning("%s is marked evaluated, but its results are gone: evaluating it again", name)
            need_eval = True  # (the marker alone would report success with no results on disk)
        if not (need_convert or need_eval):
            continue
        lock = Lock(iteration_lock_path(ckpt, it), lock_ttl)
        if not lock.acquire():
            log.info("%s is being converted or evaluated by another process, skipping", name)
            continue
        try:
            if need_convert:
                try:
                    record = convert(layout.iter_dir(ckpt, it))
                except Exception as exc:
                    log.error("conversion of %s failed: %s", name, exc)
                    write_json(done_dir / f"{name}.failed", {"iteration": it, "error": str(exc),
                                                            "record": getattr(exc, "record", None)})
                    failed.append(it)
                    continue
                write_json(done_dir / f"{name}.done", {"iteration": it, "time": time.time(), **record})
                converted.append(it)
                log.info("converted %s", name)
                # a forced export that replaced hf/ removed the evaluation markers with the results they stood for
                need_eval = evaluate is not None and not any(eval_marker(ckpt, it, eval_key, s).exists()
                                                             for s in ("done", "failed"))
            if need_eval and evaluate is not None:
                try:
                    summary = evaluate(layout.iter_dir(ckpt, it))
                except Exception as exc:
                    log.error("evaluation of %s failed: %s", name, exc)
                    write_json(eval_marker(ckpt, it, eval_key, "failed"), {"iteration": it, "error": str(exc)})
                    failed.append(it)
                    continue
                write_json(eval_marker(ckpt, it, eval_key, "done"), {"iteration": it, "time": time.time(),
                                                                     "summary": summary})
                log.info("evaluated %s (%s)", name, eval_key)
        finally:
            lock.release()
    return converted, failed


def _first_line(path: Path) -> str:
    """The first non-blank line of a marker (at most 200 characters); "" for an empty, blank or unreadable one (a
    FAILED_NAN of blank lines must not crash upload-all --poll)."""
    try:
        text = read_regular(path, 1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""
    return next((ln.strip()[:200] for ln in text.splitlines() if ln.strip()), "")


def earlier_failures(ckpt: Path, eval_key: str | None = None,
                     exported: Callable[[Path], bool] | None = None) -> dict[int, str]:
    """Complete iterations that a pass skips because an earlier attempt failed (its ``.failed`` marker: not retried
    automatically), each with why: what the summary names, so an old failure never reads as "failed none"."""
    out: dict[int, str] = {}
    for it in layout.complete_iterations(ckpt):
        markers = [(ckpt / DONE_DIR / f"{layout.iter_dirname(it)}.failed", "conversion")]
        if exported is not None and exported(layout.iter_dir(ckpt, it)):
            markers = []  # exported since (by hand): the conversion's old failure no longer stands
        if eval_key is not None:
            markers.append((eval_marker(ckpt, it, eval_key, "failed"), "evaluation"))
        for marker, what in markers:
            if marker.is_file():
                try:
                    error = str(read_json(marker).get("error") or "")[:200]
                except (OSError, ValueError, AttributeError):
                    error = "unreadable marker"
                out[it] = (f"its {what} failed before ({error or 'no error recorded'}): not retried; remove {marker} "
                           "to try again")
                break
    return out


def upload_all(ckpt: Path, convert: Callable[[Path], dict], *, poll: bool, interval: float = 60.0,
               idle_timeout: float | None = None, lock_ttl: float = 3600,
               evaluate: Callable[[Path], dict] | None = None, eval_key: str = "eval",
               exported: Callable[[Path], bool] | None = None,
               evaluated: Callable[[Path], bool] | None = None) -> tuple[list[int], list[int]]:
    """Convert (and evaluate) until done; (converted, failed). ``failed`` also holds every complete iteration left
    without its export or evaluation by an earlier failure (:func:`earlier_failures`, each logged with why)."""
    all_conv, all_failed = [], []
    last_new = last_status = time.time()

    status_every = progress_interval()
    while True:
        finished_before = training_finished(ckpt)
        conv, failed = convert_pending(ckpt, convert, lock_ttl, evaluate, eval_key, exported, evaluated)
        all_conv += conv
        all_failed += failed
        if conv or failed:
            last_new = time.time()
        if not poll or finished_before:
            tracked = layout.read_tracker(ckpt)
            if tracked is not None and tracked not in layout.complete_iterations(ckpt):
                state = "incomplete" if tracked in layout.list_iterations(ckpt) else "missing"
                log.error("%s names iteration %d, but %s is %s: it was not converted (the run's final checkpoint, "
                          "if training has finished)", layout.TRACKER, tracked, layout.iter_dirname(tracked), state)
                all_failed.append(tracked)
            elif finished_before and poll:
                log.info("training has finished and every complete iteration is converted; stopping")
            break
        failure = training_failed(ckpt)
        if failure is not None:  # no further checkpoint will come: polling on would hold the node to its time limit
            log.error("the training has failed (%s: %s); every complete iteration is converted; stopping", failure,
                      _first_line(failure))
            break
        if idle_timeout is not None and time.time() - last_new > idle_timeout:
            log.info("no new checkpoint for %.0f s; stopping", idle_timeout)
            break
        if time.time() - last_status >= status_every:  # a line in the Slurm log while waiting
            last_status = time.time()
            log.info("upload-all: %d converted, %d failed so far; latest complete iteration %s; training still "
                     "running; polling every %g s", len(all_conv), len(all_failed), layout.latest_complete(ckpt),
                     interval)
        time.sleep(interval)
    for it, why in earlier_failures(ckpt, eval_key if evaluate is not None else None, exported).items():
        if it not in all_failed:
            log.error("%s has no export%s: %s", layout.iter_dirname(it),
                      " or evaluation" if evaluate is not None else "", why)
            all_failed.append(it)
    return all_conv, sorted(all_failed)
