"""Every Megatron Bridge name we use exists in the pinned wheel (source parsed, not imported), and the check
fails when a used name is renamed (shown on a doctored copy)."""

import shutil

import pytest

from pipeline.bridge import BRIDGE_API, CORE_API
from pipeline.training.conformance import check, fetch_wheel_source, pinned_version
from tests.helpers import ROOT
from tests.tiers import tier_unavailable

pytestmark = pytest.mark.bridge


@pytest.fixture(scope="module")
def wheel_source():
    try:
        return fetch_wheel_source(pinned_version(), ROOT / ".cache" / "wheels")
    except Exception as exc:
        tier_unavailable("bridge", f"cannot download megatron-bridge=={pinned_version()} from PyPI: {exc}")


def test_pinned_wheel_has_every_name(wheel_source):
    assert check(wheel_source, BRIDGE_API) == []


def test_renamed_method_and_kwarg_are_reported(wheel_source, tmp_path):
    doctored = tmp_path / "src"
    shutil.copytree(wheel_source / "megatron", doctored / "megatron")
    ab = doctored / "megatron/bridge/models/conversion/auto_bridge.py"
    text = ab.read_text()
    assert "    def export_ckpt(" in text
    ab.write_text(text.replace("    def export_ckpt(", "    def export_checkpoint(")
                  .replace("        hf_model_id: str | Path,", "        hf_id: str | Path,"))
    problems = check(doctored, BRIDGE_API)
    assert any("AutoBridge.export_ckpt: method 'export_ckpt' not found" in p for p in problems)
    assert any("AutoBridge.import_ckpt: no keyword argument(s) ['hf_model_id']" in p for p in problems)


def test_recipe_alias_rename_is_reported(wheel_source, tmp_path):
    doctored = tmp_path / "src"
    shutil.copytree(wheel_source / "megatron", doctored / "megatron")
    f = doctored / "megatron/bridge/recipes/nemotronh/nemotron_3_nano.py"
    f.write_text(f.read_text().replace("as nemotron_3_nano_sft_config", "as nemotron_3_nano_sft_cfg"))
    assert any("nemotron_3_nano_sft_config" in p for p in check(doctored, BRIDGE_API))


def test_restated_recipe_values_match_the_wheel(wheel_source, tmp_path):
    from pipeline.config.models import REGISTRY
    from pipeline.training.conformance import check_recipe_facts

    assert check_recipe_facts(wheel_source, REGISTRY) == []
    doctored = tmp_path / "src"
    shutil.copytree(wheel_source / "megatron", doctored / "megatron")
    f = doctored / "megatron/bridge/recipes/nemotronh/h100/nemotron_3_nano.py"
    text = f.read_text()
    assert "    model.expert_model_parallel_size = 8\n" in text
    f.write_text(text.replace("    model.expert_model_parallel_size = 8\n", "    model.expert_model_parallel_size = 16\n", 1))
    problems = check_recipe_facts(doctored, REGISTRY)
    assert any("nano/sft: model.expert_model_parallel_size = 16" in p for p in problems), problems


def test_pinned_megatron_core_has_every_name():
    """The megatron-core names of the generation across pipeline stages and the model-parallel groups."""
    import re

    pin = re.search(r"^megatron-core==(\S+)", (ROOT / "3rdparty" / "requirements-container.txt").read_text(), re.M)
    try:
        core = fetch_wheel_source(pin.group(1), ROOT / ".cache" / "wheels", package="megatron-core")
    except Exception as exc:
        tier_unavailable("bridge", f"cannot download megatron-core=={pin.group(1)} from PyPI: {exc}")
    assert check(core, CORE_API) == []
    assert check(core, [("megatron.core.parallel_state", "initialize_model_parallel", ("no_such_kwarg",))])
