"""LoRA iterations (issue 32, item 5): Bridge saves only the adapter weights of a PEFT run, so the suite detects one
from its run_config.yaml and either merges it into the run's exact Hugging Face base or refuses in one line naming
the base checkpoint and what to run. Here: the detection on a run_config.yaml as Bridge writes it (its
``ConfigContainer.to_yaml``, ``!!set`` included), which base counts as known, and the one-line refusals of export
and of the coherence megatron backend (plan and ``bridge.generate``). No process, no Megatron: the merge itself
runs in the megatron_cpu tier (tests/megatron_cpu/test_lora_cpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import bridge
from pipeline.checkpoint import export as ex
from pipeline.cli.coherence import plan_from_argv as coherence_plan
from pipeline.common import layout
from pipeline.common.errors import UserError

# Trimmed from the run_config.yaml Bridge 0.6.2 writes (ConfigContainer.to_yaml through safe_yaml_representers): the
# peft section exactly as Bridge serialises LoRA(dim=8, alpha=16), the sections the suite reads, nothing rewritten.
RUN_CONFIG = """_target_: megatron.bridge.training.config.ConfigContainer
checkpoint:
  _target_: megatron.bridge.training.config.CheckpointConfig
  ckpt_format: torch_dist
  finetune: {finetune}
  load: null
  pretrained_checkpoint: {pretrained}
  save: {save}
model:
  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider
  hf_model_id: {hf}
  num_layers: 4
peft: {peft}
train: {train}
"""
PEFT = """
  _target_: {target}
  a2a_experimental: false
  alpha: 16
  canonical_mapping: {{}}
  dim: 8
  dropout: 0.0
  dropout_position: pre
  exclude_modules: []
  experts_shared_outer_loras: false
  lora_A_init_method: xavier
  lora_B_init_method: zero
  lora_dtype: null
  normalize_moe_lora: false
  params_to_save: !!set {{}}
  sequence_parallel_input_regather: false
  share_expert_adapters: true
  target_modules:
  - linear_qkv
  - linear_proj
  - linear_fc1
  - linear_fc2"""
TRAIN = """
  _target_: megatron.bridge.training.config.TrainingConfig
  exit_signal:
    _args_:
    - 15
    _call_: true
    _name_: SIGTERM
    _target_: signal.Signals
  train_iters: 2"""
LORA = "megatron.bridge.peft.lora.LoRA"


def _iteration(save: Path, n: int, *, hf: str, pretrained: str | None = None, peft: str | None = None,
               trained: bool = False) -> Path:
    """A complete Megatron iteration directory (metadata.json, a shard, run_config.yaml) and the tracker."""
    it = layout.iter_dir(save, n)
    it.mkdir(parents=True)
    (it / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (it / "__0_0.distcp").write_bytes(b"\0")
    (it / "run_config.yaml").write_text(RUN_CONFIG.format(
        finetune="true" if peft else "false", pretrained=pretrained or "null", save=save, hf=hf,
        peft=PEFT.format(target=peft) if peft else "null", train=TRAIN if (trained or peft) else "null"))
    layout.write_tracker(save, n)
    return it


@pytest.fixture
def run(tmp_path):
    """An HF model folder, Bridge's import of it (iteration 0, no train:) and a LoRA run on it (iteration 2)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"vocab_size": 384}')
    base = _iteration(tmp_path / "meg", 0, hf=str(hf))
    lora = _iteration(tmp_path / "lora", 2, hf=str(hf), pretrained=str(tmp_path / "meg"), peft=LORA)
    return hf, base, lora


def test_a_lora_iteration_is_detected_from_bridges_run_config(run):
    hf, base, lora = run
    peft = bridge.peft_iteration(lora)
    assert peft is not None and peft.is_lora and peft.target == LORA
    assert peft.pretrained_checkpoint == str(base.parent)
    assert peft.settings == {"target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                             "exclude_modules": [], "dim": 8, "alpha": 16, "dropout": 0.0, "dropout_position": "pre",
                             "normalize_moe_lora": False, "share_expert_adapters": True}
    assert bridge.peft_iteration(base) is None  # Bridge's import: peft: null
    assert bridge.hf_import_source(base) == str(hf) and bridge.hf_import_source(lora) is None


def test_a_whole_checkpoint_without_run_config_is_not_peft(tmp_path):
    it = tmp_path / "iter_0000004"
    it.mkdir()
    (it / "metadata.json").write_text("{}")
    assert bridge.peft_iteration(it) is None


def test_the_base_is_known_when_it_is_bridges_import_of_the_hf_model(run):
    hf, base, lora = run
    assert ex.lora_base(bridge.peft_iteration(lora), str(hf)) == base
    assert ex.lora_base(bridge.peft_iteration(lora), str(hf) + "/") == base  # the same directory


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_export_on_another_hf_model_names_the_one_the_base_was_imported_from(run, tmp_path):
    hf, base, lora = run
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(UserError) as e:
        ex.export_iteration(lora, ex.ExportRequest(hf_model=str(other), reasoning=False))
    msg = _one_line(e)
    assert f"{lora} is a LoRA iteration" in msg and f"its base checkpoint {base} was imported from {hf}" in msg
    assert msg.endswith(f"rerun the export with --hf-model {hf}")
    assert not (lora / "hf").exists()


def test_export_on_a_trained_base_says_to_export_the_base_first(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    base = _iteration(tmp_path / "sft", 100, hf=str(hf), trained=True)  # a trained save: its weights are not hf's
    lora = _iteration(tmp_path / "lora", 2, hf=str(hf), pretrained=str(base.parent), peft=LORA)
    with pytest.raises(UserError) as e:
        ex.export_iteration(lora, ex.ExportRequest(hf_model=str(hf), reasoning=False))
    msg = _one_line(e)
    assert f"its base checkpoint {base} is not a Hugging Face import" in msg
    assert (f"export the base first (python -m pipeline.cli.checkpoint export {base.parent} --iteration 100 "
            "--hf-model ID") in msg
    assert msg.endswith(f"then rerun this export with --hf-model {base / 'hf'}")


def test_the_bases_own_verified_export_is_a_known_base(tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    hf.mkdir()
    base = _iteration(tmp_path / "sft", 100, hf=str(hf), trained=True)
    lora = _iteration(tmp_path / "lora", 2, hf=str(hf), pretrained=str(base.parent), peft=LORA)
    (base / "hf").mkdir()
    monkeypatch.setattr(ex, "published_export", lambda out: {"verdict": "PASS"} if out == base / "hf" else None)
    assert ex.lora_base(bridge.peft_iteration(lora), str(base / "hf")) == base


def test_export_without_a_recorded_base_or_of_dora_is_refused(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    orphan = _iteration(tmp_path / "a", 2, hf=str(hf), peft=LORA)
    with pytest.raises(UserError) as e:
        ex.export_iteration(orphan, ex.ExportRequest(hf_model=str(hf), reasoning=False))
    assert "names no base (checkpoint.pretrained_checkpoint)" in _one_line(e)
    dora = _iteration(tmp_path / "b", 2, hf=str(hf), pretrained=str(tmp_path / "a"),
                      peft="megatron.bridge.peft.dora.DoRA")
    with pytest.raises(UserError) as e:
        ex.export_iteration(dora, ex.ExportRequest(hf_model=str(hf), reasoning=False))
    assert "only LoRA adapters can be merged" in _one_line(e)


def test_coherence_megatron_plan_refuses_a_lora_iteration(run, monkeypatch):
    monkeypatch.setenv("PIPELINE_CLUSTER", "isambard_gh200")
    hf, _base, lora = run
    plan = coherence_plan([str(lora.parent), "--backend", "megatron", "--hf-model", str(hf)], 1)
    refusal = [p for p in plan.problems if "LoRA" in p]
    assert refusal == [f"{lora} is a LoRA iteration (Bridge saved only its adapter weights); the megatron backend "
                       f"generates from whole checkpoints only: export it (python -m pipeline.cli.checkpoint export "
                       f"{lora.parent} --iteration 2 --hf-model {hf} --reasoning|--no-reasoning, which merges the "
                       f"adapters into the base) and run coherence on {lora / 'hf'} with --backend hf"]
    whole = coherence_plan([str(_base.parent), "--backend", "megatron", "--hf-model", str(hf)], 1)
    assert not [p for p in whole.problems if "LoRA" in p]


def test_bridge_generate_refuses_a_lora_iteration_before_loading_anything(run):
    hf, _base, lora = run
    with pytest.raises(UserError) as e:
        bridge.generate(lora, str(hf), ["hi"], 4, tp=1, pp=1, ep=1, reasoning=False)
    assert _one_line(e).startswith(f"{lora} is a LoRA iteration")


def test_a_base_with_an_iteration_newer_than_the_lora_run_is_refused(run, tmp_path):
    """Bridge loaded the base root's latest iteration when the LoRA run started; an iteration saved after the LoRA
    iteration cannot be it, so the export refuses instead of merging into the wrong model (hostile review)."""
    import os

    hf, base, lora = run
    newer = _iteration(base.parent, 5, hf=str(hf))
    t = os.stat(lora / "metadata.json").st_mtime
    os.utime(newer / "metadata.json", (t + 60, t + 60))
    with pytest.raises(UserError) as e:
        ex.lora_base(bridge.peft_iteration(lora), str(hf))
    assert "has an iteration newer than this one (iter_0000005)" in _one_line(e)
    os.utime(newer / "metadata.json", (t - 60, t - 60))  # saved before the LoRA run: the run started from it
    assert ex.lora_base(bridge.peft_iteration(lora), str(hf)) == newer
