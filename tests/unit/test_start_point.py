"""Where a run starts (records.start_point, both engines; issue 33): its own save's latest checkpoint (a requeue)
wins over the other run's iteration it continues, which wins over pretrained weights; a continued iteration that
was never saved is one line naming the ones that were; finetune and load = save are not a continuation."""

from __future__ import annotations

import pytest

from pipeline.common import layout
from pipeline.common.errors import UserError
from pipeline.config.schema import TrainingConfig
from pipeline.training.preflight import continues_from
from pipeline.training.records import start_point


def _save_iteration(save, it, tmp_path):
    """A complete local-engine iteration, published as the engine publishes one (real safetensors)."""
    import torch
    from safetensors.torch import save_file

    staged = tmp_path / f"staged-{save.name}-{it}"
    staged.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(staged / "model.safetensors"))
    (staged / "config.json").write_text("{}")
    save.mkdir(parents=True, exist_ok=True)
    layout.publish_iteration(staged, save, it, {"engine": "local", "iteration": it})


def _cfg(**ckpt):
    return TrainingConfig.from_dict({"checkpoint": ckpt})


def test_resume_beats_continue_beats_init(tmp_path):
    prev, own = tmp_path / "pre" / "checkpoints", tmp_path / "cool" / "checkpoints"
    for it in (2, 4):
        _save_iteration(prev, it, tmp_path)
    cfg = _cfg(save=str(own), load=str(prev), ckpt_step=2)
    assert continues_from(cfg) == prev
    sp = start_point(cfg)
    assert (sp.kind, sp.iteration, sp.origin, sp.path) == ("continue", 2, 2, layout.iter_dir(prev, 2))
    assert start_point(_cfg(save=str(own), load=str(prev))).origin == 4  # no ckpt_step: its latest
    _save_iteration(own, 6, tmp_path)  # the continuing run checkpointed: a requeue resumes its own save
    sp = start_point(cfg)
    assert (sp.kind, sp.iteration, sp.origin, sp.path) == ("resume", 6, 2, layout.iter_dir(own, 6))
    # weights only, or the run's own save as load (Bridge's default): no continuation
    for other in (_cfg(save=str(tmp_path / "x"), load=str(prev), finetune=True),
                  _cfg(save=str(tmp_path / "x"), load=str(tmp_path / "x")), _cfg(save=str(tmp_path / "x"))):
        assert continues_from(other) is None and start_point(other).kind == "init"


def test_a_continued_iteration_that_was_never_saved_is_one_line(tmp_path):
    prev = tmp_path / "pre" / "checkpoints"
    _save_iteration(prev, 4, tmp_path)
    with pytest.raises(UserError, match=r"holds no iteration 3 to continue from \(complete: 4\)"):
        start_point(_cfg(save=str(tmp_path / "own"), load=str(prev), ckpt_step=3))
    with pytest.raises(UserError, match=r"holds no complete checkpoint to continue from \(complete: none\)"):
        start_point(_cfg(save=str(tmp_path / "own"), load=str(tmp_path / "empty")))
