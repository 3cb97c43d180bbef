"""Checkpoint and coherence pipelines: verified export (and a corrupted checkpoint failing it), the
convert-every-checkpoint poller across a kill, and the endpoint backend against a real local server."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from tests.helpers import ROOT, run

pytestmark = pytest.mark.slow
PY = str(ROOT / ".venv/bin/python")
TRAIN = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--disable-ft"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    env = {**os.environ, "PIPELINE_DATA_ROOT": str(tmp / "data"), "PIPELINE_RUNS_DIR": str(tmp / "runs"),
           "WANDB_DIR": str(tmp / "wandb"), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    run([PY, "pipeline_data_prepare.py", "prepare", "--dataset", "chatterbot-corpus", "--seq-length", "256",
         "--limit", "800", "--quiet"], env=env, check=True)
    run(["bash", "pipeline_training_launch.sh", *TRAIN, "--run-dir", str(tmp / "run")], env=env, check=True)
    return env, tmp / "run" / "checkpoints"


def convert(env, *args):
    return run(["bash", "pipeline_checkpoint_convert.sh", *args], env=env)


def test_export_loads_and_records_verification(trained):
    env, ckpt = trained
    res = convert(env, "export", str(ckpt), "--hf-model", "pipeline/tiny-qwen3-moe", "--no-reasoning")
    assert res.returncode == 0, res.stderr[-2000:]
    hf = ckpt / "iter_0000040" / "hf"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.model_type == "qwen3_moe"
    ver = json.loads((hf / "verification.json").read_text())
    assert ver["verdict"] == "PASS" and ver["max_abs_logit_diff"] <= ver["logit_tolerance"]
    assert ver["reference_loss"] < 0.8 * ver["uniform_loss"]
    assert all(g["generation"].strip() for g in ver["generations"])
    again = convert(env, "export", str(ckpt), "--hf-model", "pipeline/tiny-qwen3-moe", "--no-reasoning")
    assert "already exported and verified" in again.stderr


@pytest.mark.parametrize("corruption", ["zero_embeddings", "drop_embeddings"])
def test_corrupted_checkpoint_fails_verification(trained, tmp_path, corruption):
    from safetensors.torch import load_file, save_file

    env, ckpt = trained
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt / "iter_0000020", bad / "iter_0000020")
    (bad / "latest_checkpointed_iteration.txt").write_text("20\n")
    st = bad / "iter_0000020" / "model.safetensors"
    tensors = load_file(st)
    emb = next(k for k in tensors if "embed_tokens" in k)
    if corruption == "zero_embeddings":
        tensors[emb] = tensors[emb] * 0
    else:
        del tensors[emb]
    save_file(tensors, st, metadata={"format": "pt"})
    res = convert(env, "export", str(bad), "--hf-model", "pipeline/tiny-qwen3-moe", "--no-reasoning")
    assert res.returncode == 1
    assert "FAILED verification" in res.stderr
    assert not (bad / "iter_0000020" / "hf").exists()
    rec = json.loads((bad / "iter_0000020" / "hf_verification_FAILED.json").read_text())
    assert rec["verdict"] == "FAIL" and rec["failures"]
    assert not list((bad / "iter_0000020").glob(".hf.*"))  # no half-written export left behind


def test_missing_iteration_and_flags_are_one_line_errors(trained):
    env, ckpt = trained
    res = convert(env, "export", str(ckpt), "--hf-model", "x/y", "--no-reasoning", "--iteration", "999")
    assert res.returncode == 2
    assert res.stderr.strip() == (f"error: iteration 999 does not exist in {ckpt}; complete iterations: 20, 40")


def test_upload_all_poll_converts_each_iteration_once_across_a_kill(trained, tmp_path):
    env, base = trained
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    # Continue from the trained tiny model at a low rate, so every checkpoint is a healthy model that passes
    # verification (a 10-step random-init model rightly fails it).
    trainer = subprocess.Popen(["bash", "pipeline_training_launch.sh", *TRAIN, "--run-dir", str(run_dir),
                                f"checkpoint.pretrained_checkpoint={base}", "optimizer.lr=1e-4",
                                "optimizer.min_lr=1e-5", "train.train_iters=50", "checkpoint.save_interval=10"],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not ckpt.is_dir():
        time.sleep(0.2)
    poll = ["bash", "pipeline_checkpoint_convert.sh", "upload-all", str(ckpt), "--hf-model", "pipeline/tiny-qwen3-moe",
            "--no-reasoning", "--poll", "--interval", "1"]
    log1 = open(tmp_path / "poll1.log", "w")
    p1 = subprocess.Popen(poll, cwd=ROOT, env=env, stdout=log1, stderr=subprocess.STDOUT, start_new_session=True)
    done_dir = ckpt / "converted_checkpoints"
    deadline = time.time() + 300
    while not (done_dir.exists() and list(done_dir.glob("*.done"))):
        assert time.time() < deadline and not (done_dir.exists() and list(done_dir.glob("*.failed")))
        time.sleep(0.2)
    os.killpg(p1.pid, signal.SIGKILL)  # mid-run: it may be holding a lock on the next iteration
    p1.wait()
    p2 = run(poll, env=env, timeout=600)
    assert trainer.wait(timeout=600) == 0
    assert p2.returncode == 0, p2.stderr[-2000:]
    done = sorted(p.name for p in done_dir.glob("*.done"))
    assert done == [f"iter_{i:07d}.done" for i in (10, 20, 30, 40, 50)]
    logs = (tmp_path / "poll1.log").read_text() + p2.stdout + p2.stderr
    for i in (10, 20, 30, 40, 50):
        assert logs.count(f"converted iter_{i:07d}") == 1, i
    assert not list((ckpt / "in_progress_checkpoints").glob("*.lock"))
    assert "training has finished" in p2.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_backend_matches_hf_backend(smollm2_dir, tmp_path, pipeline_env):
    # transformers' own CLI is part of the venv (transformers is pinned): missing, it is a broken install, not a skip
    assert shutil.which("transformers", path=str(ROOT / ".venv/bin")), "transformers CLI missing from .venv/bin"
    port = _free_port()
    server = subprocess.Popen([str(ROOT / ".venv/bin/transformers"), "serve", str(smollm2_dir), "--port", str(port),
                               "--host", "127.0.0.1"], env=pipeline_env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        import urllib.request

        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, "server did not come up"
                time.sleep(1)
        disc = tmp_path / "serve.endpoint"
        disc.write_text(json.dumps({"url": f"http://127.0.0.1:{port}"}))
        common = ["--max-tokens", "32", "--no-wandb"]
        e = run([PY, "pipeline_coherence_test.py", str(smollm2_dir), "--backend", "endpoint", "--discovery-file",
                 str(disc), "--output-dir", str(tmp_path / "e"), *common], env=pipeline_env)
        h = run([PY, "pipeline_coherence_test.py", str(smollm2_dir), "--output-dir", str(tmp_path / "h"), *common],
                env=pipeline_env)
        assert e.returncode == 0 and h.returncode == 0, e.stderr[-2000:] + h.stderr[-2000:]
        er = json.loads((tmp_path / "e" / "coherence_endpoint.json").read_text())["results"][0]["rows"]
        hr = json.loads((tmp_path / "h" / "coherence_hf.json").read_text())["results"][0]["rows"]
        assert [r["prompt"] for r in er] == [r["prompt"] for r in hr] and len(er) == 8
        assert not any(r["empty"] for r in er)
        same = sum(a["response"][:40] == b["response"][:40] for a, b in zip(er, hr))
        assert same >= 6, [(a["response"][:60], b["response"][:60]) for a, b in zip(er, hr)]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_unreachable_endpoint_is_one_line(pipeline_env):
    res = run([PY, "pipeline_coherence_test.py", "m", "--backend", "endpoint", "--endpoint-url",
               "http://127.0.0.1:9", "--no-wandb"], env=pipeline_env)
    assert res.returncode == 2
    assert res.stderr.startswith("error: endpoint http://127.0.0.1:9 is unreachable")
    assert res.stderr.count("\n") == 1


def test_a_coherence_run_gets_the_cluster_profiles_env(smollm2_dir, tmp_path, pipeline_env):
    """The profile's env reaches a coherence run that runs in process (the hf backend; the megatron backend's
    torchrun inherits the same environment): the W&B run lands in the profile's WANDB_DIR, not the inherited one
    (issue 32, item 8: before, only training read the profile's env)."""
    profile = tmp_path / "probe.yaml"
    profile.write_text(f"name: probe\nenv:\n  PIPELINE_PROBE_VAR: marker\n  WANDB_DIR: {tmp_path / 'profile-wandb'}\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n")
    res = run([PY, "pipeline_coherence_test.py", str(smollm2_dir), "--prompts", str(prompts), "--max-tokens", "4",
               "--output-dir", str(tmp_path / "out"), "--quiet"], env={**pipeline_env, "PIPELINE_CLUSTER": str(profile)})
    assert res.returncode == 0, res.stderr[-2000:]
    wandb_dir = json.loads((tmp_path / "out" / "coherence_hf.json").read_text())["wandb_dir"]
    assert wandb_dir.startswith(str(tmp_path / "profile-wandb") + "/"), (wandb_dir, pipeline_env["WANDB_DIR"])


def test_upload_all_with_coherence_reports_each_export(trained, tmp_path):
    env, ckpt = trained
    copy = tmp_path / "ckpts"
    shutil.copytree(ckpt, copy, ignore=shutil.ignore_patterns("hf", "converted_checkpoints", "in_progress_checkpoints",
                                                              "hf_verification_FAILED.json"))
    res = convert(env, "upload-all", str(copy), "--hf-model", "pipeline/tiny-qwen3-moe", "--no-reasoning",
                  "--coherence")
    assert res.returncode == 0, res.stderr[-2000:]
    for it in (20, 40):
        rep = json.loads((copy / f"iter_{it:07d}" / "hf" / "coherence" / "coherence_hf.json").read_text())
        assert len(rep["results"][0]["rows"]) == 8
        done = json.loads((copy / "converted_checkpoints" / f"iter_{it:07d}.done").read_text())
        assert done["verdict"] == "PASS" and "coherence_exit_code" in done


def _copy_ckpt(ckpt, dst):
    shutil.copytree(ckpt, dst, ignore=shutil.ignore_patterns("hf", "converted_checkpoints", "in_progress_checkpoints",
                                                             "hf_verification_FAILED.json", ".hf.*"))
    return dst


def _wait_for(path, proc, timeout=300):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, "the first export ended before taking its lock"
        time.sleep(0.05)


def test_two_exports_of_one_iteration_never_publish_a_broken_export(trained, tmp_path):
    """One export paused while holding the iteration's lock: a second is refused with one line; the first then
    publishes a complete, verified hf/; a third finds it done. A writer killed outright leaves a lock whose
    process is gone: the next export takes it over and publishes."""
    from pipeline.checkpoint.export import published_export

    env, ckpt = trained
    copy = _copy_ckpt(ckpt, tmp_path / "ck")
    cmd = ["bash", "pipeline_checkpoint_convert.sh", "export", str(copy), "--hf-model", "pipeline/tiny-qwen3-moe",
           "--no-reasoning", "--iteration", "20"]
    lock = copy / "in_progress_checkpoints" / "iter_0000020.lock"
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    _wait_for(lock, first)
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        second = run(cmd, env=env)
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
        assert "iter_0000020 is being exported by pid" in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out[-2000:]
    hf = copy / "iter_0000020" / "hf"
    rec = published_export(hf)
    assert rec is not None and rec["verdict"] == "PASS"
    assert (hf / "model.safetensors").stat().st_size > 1000
    third = run(cmd, env=env)
    assert third.returncode == 0 and "already exported and verified" in third.stderr
    assert not lock.exists() and not list((copy / "iter_0000020").glob(".hf.*"))

    # killed outright while holding the lock: the next export takes over the dead writer's lock
    copy2 = _copy_ckpt(ckpt, tmp_path / "ck2")
    cmd2 = [*cmd[:3], str(copy2), *cmd[4:]]
    lock2 = copy2 / "in_progress_checkpoints" / "iter_0000020.lock"
    dead = subprocess.Popen(cmd2, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait_for(lock2, dead)
    os.killpg(dead.pid, signal.SIGKILL)
    dead.wait()
    again = run(cmd2, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "taking over stale lock" in again.stderr
    assert published_export(copy2 / "iter_0000020" / "hf") is not None
