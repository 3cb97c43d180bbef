"""Helpers the tests import: the repository root and a runner for the real scripts."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str] | str, env: dict | None = None, timeout: float = 900, check: bool = False,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         shell=isinstance(cmd, str))
    if check and res.returncode != 0:
        raise AssertionError(f"{cmd} exited {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}")
    return res


HYBRID_GPU_PACKAGES = ("transformer-engine==2.14.0", "mamba-ssm==2.3.2.post1", "causal-conv1d==1.7.0", "deep-ep==1.2.1")


def image_record(sif: Path, packages=HYBRID_GPU_PACKAGES) -> Path:
    """The record validate's image-packages check writes beside an image (``<sif>.packages.txt``, pip freeze lines):
    what the login-node preflight reads to know the image holds the GPU packages a recipe's model selects. The
    default lists those of the hybrid family's recipes, as the NGC NeMo image holds them."""
    record = Path(str(sif) + ".packages.txt")
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("# The packages of the image, recorded by pipeline.env.validate (image-packages)\n"
                      + "".join(f"{p}\n" for p in packages))
    return record


def offline_hf_home(hf_home: Path) -> Path:
    """An offline Hugging Face cache at ``hf_home`` holding the shipped model configs (tests/assets/hf_configs/
    <org>--<name>/config.json, snapshot 0...0), so Bridge's recipes' ``AutoBridge.from_hf_pretrained("nvidia/...")``
    finds them with HF_HOME=hf_home and HF_HUB_OFFLINE=1 (no download is possible here)."""
    import shutil

    for d in sorted((ROOT / "tests" / "assets" / "hf_configs").iterdir()):
        org, name = d.name.split("--", 1)
        repo = hf_home / "hub" / f"models--{org}--{name}"
        shutil.copytree(d, repo / "snapshots" / ("0" * 40))
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0" * 40)
    return hf_home


def wandb_offline_runs(wandb_dir: Path) -> list[dict]:
    """The run records (name, project, entity) of the offline W&B runs under ``wandb_dir``, read from each run's
    ``run-*.wandb`` file (W&B's LevelDB-style log of protobuf records, parsed with wandb's own protobufs): what
    ``wandb sync`` would upload, not what our code says it logged."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    block, runs = 32768, []
    for f in sorted(Path(wandb_dir).rglob("offline-run-*/run-*.wandb")):
        data, pos, records, part = f.read_bytes(), 7, [], b""  # a 7-byte file header, then 32 KiB blocks
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if length == 0 and kind == 0:  # block padding
                pos += left
                continue
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind == 1:  # full
                records.append(chunk)
            elif kind == 2:  # first
                part = chunk
            elif kind == 3:  # middle
                part += chunk
            elif kind == 4:  # last
                records.append(part + chunk)
        for raw in records:
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "run":
                runs.append({"name": rec.run.display_name, "project": rec.run.project, "entity": rec.run.entity,
                             "file": str(f)})
                break
    return runs


def megatron_checkpoint(root, iteration: int = 10):
    """A Megatron checkpoint root with one complete iteration, by its files' names only (the plans read no tensor):
    iter_NNNNNNN/{metadata.json, common.pt, .metadata} and the tracker naming it."""
    it = Path(root) / f"iter_{iteration:07d}"
    it.mkdir(parents=True)
    for name in ("metadata.json", "common.pt", ".metadata"):
        (it / name).write_text("{}")
    (Path(root) / "latest_checkpointed_iteration.txt").write_text(f"{iteration}")
    return Path(root)
