"""The GPU ready check: the suite's GPU paths, end to end, on this node's GPUs in a few minutes.

    python -m pipeline.env.device_check [--work DIR] [--only NAME] [--timeout S]
    bash tests/gpu/device_check.sh            # the same on a bare GPU machine (wheels, import shim)

Checks (each prints one line ``device_check: NAME PASS|FAIL|SKIP (detail)``, then ``device_check: N passed, M
failed``; exit 1 on any FAIL, 2 when no CUDA GPU is visible):

  bridge-train-resume   the Bridge engine (``pipeline.training.engines.smoke``: Bridge's GPT recipe shrunk, mock
                        data) for TRAIN_ITERS steps: a save-and-exit request at step STOP_AT (the engine's
                        SAVE_AND_EXIT file -> its watcher -> Megatron's exit signal) must checkpoint at STOP_AT and
                        record the stop; a second launch on the same run must resume at STOP_AT + 1 and finish
  export-verify         a tiny Llama (tests/megatron_cpu/worker.py make-model) imported to Megatron
                        (``pipeline.cli.checkpoint import``), then ``pipeline.cli.checkpoint export --iteration N``:
                        AutoBridge's export and the suite's logit verification must pass
  megatron-generate     greedy generation from that Megatron checkpoint (``pipeline.bridge.generate``, through the
                        worker's ``generate``) must give the Hugging Face greedy text of the same weights
  bridge-sft-resume     Bridge's ``finetune()`` on the job users submit first: the Nano quickstart config as shipped,
                        planned by the product, only the model shrunk to that tiny Llama (the worker's ``sft``), on
                        packs our data pipeline writes (``pipeline_data_prepare.py prepare``); Megatron's
                        ``exit_interval`` stops it at SFT_STOP_AT with a save, a relaunch resumes it to the end, and
                        every step's loss must equal an uninterrupted run's. Skipped without Transformer Engine
                        (packed attention is TE's fused kernel; the cluster's image has it; the CPU tier maps it)

``validate --run-training`` runs the same checks through :func:`run_checks` (one line for all of them).
Every step is a subprocess with this process's environment (the wrapper's PYTHONPATH: carried wheels, the import
shim where Transformer Engine is missing) and its own timeout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.common import layout, paths
from pipeline.common.errors import UserError
from pipeline.config.cluster import resolve_profile

TRAIN_ITERS, STOP_AT, SAVE_INTERVAL = 6, 3, 2
CHECKS = ("bridge-train-resume", "export-verify", "megatron-generate", "bridge-sft-resume")
SFT_STOP_AT = 2
PREFIX = "device_check:"


class CheckFail(Exception):
    """The check ran and failed; the message is the detail."""


class CheckSkip(Exception):
    """The check cannot run here; the message says why."""


def worker_script() -> Path:
    """The megatron_cpu tier's worker (make-model, generate): reused, not copied."""
    return paths.repo_root() / "tests" / "megatron_cpu" / "worker.py"


def _tail(text: str, n: int = 1) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-300:] if lines else "no output"


def _run(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``cmd`` with its output in ``log``; a non-zero exit or a timeout is a CheckFail naming the log."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log.write_text(out)
        raise CheckFail(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} timed out after {timeout:.0f}s (log {log})") \
            from None
    log.write_text(res.stdout + "\n--- stderr ---\n" + res.stderr)
    if res.returncode != 0:
        raise CheckFail(f"{' '.join(cmd[:4])} exited {res.returncode}: {_tail(res.stdout + res.stderr)} (log {log})")
    return res


def _torchrun(gpus: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]


def _tracker(ckpt: Path) -> int | None:
    try:
        return layout.read_tracker(ckpt)
    except UserError:  # unreadable or not a number: as with none
        return None


def check_train_resume(work: Path, gpus: int, timeout: float) -> str:
    run_dir = work / "train"
    run_dir.mkdir(parents=True, exist_ok=True)
    tp = 2 if gpus % 2 == 0 else 1
    base = [*_torchrun(gpus), "-m", "pipeline.training.engines.smoke", "--run-dir", str(run_dir), "--tp", str(tp),
            "--iters", str(TRAIN_ITERS), "--save-interval", str(SAVE_INTERVAL)]
    t0 = time.time()
    _run([*base, "--request-at", str(STOP_AT)], work / "train-1.log", timeout / 2)
    first = json.loads((run_dir / "smoke.json").read_text())
    stopped = _tracker(run_dir / "checkpoints")
    if stopped != STOP_AT:
        raise CheckFail(f"save-and-exit at step {STOP_AT}: the checkpoint tracker says {stopped}")
    if (run_dir / "SAVE_AND_EXIT").exists():
        raise CheckFail("the stop was not recorded: SAVE_AND_EXIT is still there")
    if (run_dir / "TRAINING_DONE").exists():
        raise CheckFail(f"stopped at {stopped} of {TRAIN_ITERS}, yet TRAINING_DONE was written")
    _run(base, work / "train-2.log", max(60.0, timeout - (time.time() - t0)))
    second = json.loads((run_dir / "smoke.json").read_text())
    done = _tracker(run_dir / "checkpoints")
    resumed = [s["step"] for s in second["steps"]]
    marker = (run_dir / "TRAINING_DONE").exists()
    if done != TRAIN_ITERS or not marker:
        raise CheckFail(f"resume: tracker {done}, TRAINING_DONE {'present' if marker else 'missing'} "
                        f"(want {TRAIN_ITERS} and the marker)")
    if resumed != list(range(STOP_AT + 1, TRAIN_ITERS + 1)):
        raise CheckFail(f"resume ran steps {resumed}, want {STOP_AT + 1}..{TRAIN_ITERS}")
    losses = [s["loss"] for s in first["steps"] + second["steps"]]
    optimizer = ("distributed optimizer" if second.get("distributed_optimizer")
                 else f"distributed optimizer off: {second.get('distributed_optimizer_note') or 'by override'}")
    return (f"{gpus} GPU(s) tp {tp}: steps 1..{STOP_AT}, save-and-exit at {stopped}, resumed {resumed[0]}.."
            f"{resumed[-1]}; loss {losses[0]:.3f} -> {losses[-1]:.3f}; {optimizer}; {time.time() - t0:.0f}s")


def _tiny_model(work: Path, timeout: float) -> tuple[Path, Path, int]:
    """The tiny Llama and its Megatron import, made once for the export and generation checks: (HF dir, Megatron
    checkpoint root, its iteration)."""
    hf, mcore = work / "tiny-llama", work / "tiny-llama-megatron"
    worker = worker_script()
    if not worker.is_file():
        raise CheckSkip(f"{worker} is not in this checkout (the tiny model comes from the megatron_cpu worker)")
    if not (hf / "hf_greedy.json").is_file():
        _run([sys.executable, str(worker), "make-model", str(hf)], work / "make-model.log", timeout)
    if _tracker(mcore) is None:
        _run([sys.executable, "-m", "pipeline.cli.checkpoint", "import", str(hf), "--output", str(mcore)],
             work / "import.log", timeout)
    it = _tracker(mcore)
    if it is None:
        raise CheckFail(f"the import wrote no checkpoint tracker under {mcore}")
    return hf, mcore, it


def verdict_record(out: str) -> dict:
    """The export's verification record in its output: the JSON object printed from a line ``{`` to a line ``}``
    (Megatron's own lines before it print Python dicts on one line, which are not it)."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line == "{" and "}" in lines[i:]:
            try:
                rec = json.loads("\n".join(lines[i:lines.index("}", i) + 1]))
            except ValueError:
                continue
            if isinstance(rec, dict) and "verdict" in rec:
                return rec
    return {}


def check_export(work: Path, gpus: int, timeout: float) -> str:
    t0 = time.time()
    hf, mcore, it = _tiny_model(work, timeout / 2)
    res = _run([sys.executable, "-m", "pipeline.cli.checkpoint", "export", str(mcore), "--iteration", str(it),
                "--hf-model", str(hf), "--no-reasoning", "--tp", "1", "--pp", "1", "--ep", "1"],
               work / "export.log", max(60.0, timeout - (time.time() - t0)))
    out = res.stdout
    rec = verdict_record(out)
    if not rec.get("verdict") or "exported:" not in out:
        raise CheckFail(f"export printed no verdict: {_tail(out)}")
    return (f"iteration {it} of the tiny Llama: verdict {rec['verdict']}, max |dlogit| "
            f"{rec.get('max_abs_logit_diff')}, top-1 {rec.get('top1_agreement')}; {time.time() - t0:.0f}s")


def check_generate(work: Path, gpus: int, timeout: float) -> str:
    t0 = time.time()
    hf, mcore, it = _tiny_model(work, timeout / 2)
    want = json.loads((hf / "hf_greedy.json").read_text())
    n = max(len(w["tokens"]) + (1 if w["finished"] else 0) for w in want)
    out = work / "megatron_greedy.json"
    _run([sys.executable, str(worker_script()), "generate", str(layout.iter_dir(mcore, it)), str(hf), str(n),
          "1", "1", "1", str(out)], work / "generate.log", max(60.0, timeout - (time.time() - t0)))
    got = json.loads(out.read_text())
    same = [g["text"] == w["text"] for g, w in zip(got, want, strict=True)]
    if not all(same):
        bad = next(i for i, s in enumerate(same) if not s)
        raise CheckFail(f"{sum(same)}/{len(same)} prompts match Hugging Face greedy; prompt {bad}: megatron "
                        f"{got[bad]['text']!r} vs hf {want[bad]['text']!r}")
    return f"{len(same)}/{len(same)} prompts identical to Hugging Face greedy ({n} tokens); {time.time() - t0:.0f}s"


def _progress(run_dir: Path) -> list[dict]:
    path = run_dir / "progress.ndjson"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def check_sft_resume(work: Path, gpus: int, timeout: float) -> str:
    if importlib.util.find_spec("transformer_engine") is None:
        raise CheckSkip("no Transformer Engine in this Python: packed (THD) attention is its fused kernel (the "
                        "cluster's image has it; the megatron_cpu tier runs this job on CPU processes)")
    t0 = time.time()
    hf, mcore, _ = _tiny_model(work, timeout / 4)
    worker = worker_script()
    data = work / "sft-data"
    if not (data / "training.jsonl").is_file():
        chat = work / "sft-chat.jsonl"
        _run([sys.executable, str(worker), "chat", str(chat)], work / "sft-chat.log", 60.0)
        _run([sys.executable, str(paths.repo_root() / "pipeline_data_prepare.py"), "prepare", "--dataset",
              str(chat), "--seq-length", "256", "--tokenizer", str(hf),
              "--pad-seq-to-mult", "16", "--val-fraction", "0.3", "--dataset-root", str(data), "--workers", "1",
              "--quiet"], work / "sft-prepare.log", timeout / 4)
    runs = {}
    for name, extra in (("straight", []), ("resumed", [f"+train.exit_interval={SFT_STOP_AT}"])):
        run_dir = work / f"sft-{name}"
        for attempt in (1, 2) if name == "resumed" else (1,):
            left = max(60.0, timeout - (time.time() - t0))
            _run([sys.executable, str(worker), "sft", str(data), str(hf), str(mcore), str(run_dir), *extra],
                 work / f"sft-{name}-{attempt}.log", left)
            if name == "resumed" and attempt == 1 and _tracker(run_dir / "checkpoints") != SFT_STOP_AT:
                raise CheckFail(f"exit_interval {SFT_STOP_AT}: the tracker says {_tracker(run_dir / 'checkpoints')}")
        runs[name] = _progress(run_dir)
        if not (run_dir / "TRAINING_DONE").exists():
            raise CheckFail(f"the {name} run did not complete (see {run_dir / 'launch.log'})")
    straight, resumed = ([p["loss"] for p in runs[k]] for k in ("straight", "resumed"))
    if not straight or resumed != straight:
        raise CheckFail(f"resumed losses {resumed} differ from the uninterrupted run's {straight}")
    return (f"finetune() of the Nano quickstart (tiny model) on {gpus} GPU(s): stopped at {SFT_STOP_AT}, resumed, "
            f"losses equal to the uninterrupted run's ({straight[0]:.3f} -> {straight[-1]:.3f}); "
            f"{time.time() - t0:.0f}s")


FUNCS: dict[str, Callable[[Path, int, float], str]] = {
    "bridge-train-resume": check_train_resume, "export-verify": check_export, "megatron-generate": check_generate,
    "bridge-sft-resume": check_sft_resume}
TIMEOUTS = {"bridge-train-resume": 240.0, "export-verify": 180.0, "megatron-generate": 120.0,
            "bridge-sft-resume": 300.0}


def gpu_profile(work: Path, gpus: int) -> dict[str, str]:
    """The environment the checks' CLIs need: where the selected cluster profile has no GPUs (a bare GPU machine
    outside the cluster), a profile written for this node (its GPU count and memory; venv, torchrun, offline)."""
    import torch

    if resolve_profile().has_gpus:
        return {}
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    prof = work / "this_gpu_node.yaml"
    prof.write_text("# written by pipeline.env.device_check: this machine as a one-node GPU cluster profile\n"
                    f"name: device_check_node\ndescription: \"{gpus} x {torch.cuda.get_device_name(0)}\"\n"
                    f"runtime: venv\ngpus_per_node: {gpus}\ngpu_memory_gb: {int(mem)}\nhost_memory_gb: 64\n"
                    f"cpus_per_node: {os.cpu_count() or 1}\nlauncher: torchrun\nhub_offline: true\n"
                    "wandb_mode: offline\n")
    return {"PIPELINE_CLUSTER": str(prof), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


def run_checks(work: Path, *, gpus: int, only: list[str] | None = None, say: Callable[[str], None] = print,
               timeout_scale: float = 1.0) -> tuple[int, int, list[str]]:
    """Run the checks (``only``: a subset, in CHECKS' order); ``say`` gets each summary line. Returns (passed,
    failed, the lines)."""
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(gpu_profile(work, gpus))
    passed = failed = 0
    lines: list[str] = []
    for name in CHECKS:
        if only and name not in only:
            continue
        try:
            detail = FUNCS[name](work, gpus, TIMEOUTS[name] * timeout_scale)
            status = "PASS"
            passed += 1
        except CheckSkip as exc:
            status, detail = "SKIP", str(exc)
        except Exception as exc:  # a check's own failure, or anything it did not expect: one line, not a traceback
            status, detail = "FAIL", (str(exc) or type(exc).__name__).splitlines()[0]
            failed += 1
        line = f"{PREFIX} {name} {status} ({detail})"
        lines.append(line)
        say(line)
    return passed, failed, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.env.device_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, help="working folder (default: a new temporary one)")
    ap.add_argument("--only", action="append", choices=CHECKS, help="run only this check (repeatable)")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every check's timeout")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"{PREFIX} refused: no CUDA GPU visible (torch {torch.__version__}); run it on a GPU machine")
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="device-check-"))
    print(f"{PREFIX} {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"work {work}", flush=True)
    passed, failed, _ = run_checks(work, gpus=torch.cuda.device_count(), only=args.only,
                                   say=lambda s: print(s, flush=True), timeout_scale=args.timeout_scale)
    print(f"{PREFIX} {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
