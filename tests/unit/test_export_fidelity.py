"""Export verification catches a corrupted export (issue 21): a perturbed tensor fails on the logits (max diff and
KL), a removed tensor fails the file-set check naming it, a faithful export passes with KL 0 and top-1 agreement 1,
and the tied/untied output-embedding rule. Real local-engine checkpoints (a tiny random-init Llama with the SmolLM2
tokenizer, written as the local engine publishes an iteration) go through the real export flow; only a PASS is
published to ``hf/``."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from pipeline.checkpoint.export import ExportRequest, _copy_local, _verify_and_publish, export_iteration
from pipeline.checkpoint.verify import FAILED, VerificationFailed, file_set_failures, file_set_problems
from pipeline.common import layout
from pipeline.common.io import read_json

HIDDEN, INTER = 32, 64


def _save_iteration(save, tokenizer, *, tied: bool):
    """``<save>/iter_0000001``: a 1-layer random-init Llama as the local engine publishes a checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tied)
    staged = save / "staged"
    LlamaForCausalLM(cfg).save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    return layout.publish_iteration(staged, save, 1, {"engine": "local", "model": "test-llama", "iteration": 1})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("fidelity")
    return {kind: _save_iteration(root / kind, tokenizer, tied=kind == "tied") for kind in ("untied", "tied")}


def _copy(iter_path, dst):
    shutil.copytree(iter_path, dst / iter_path.name)
    return dst / iter_path.name


def _edit_tensors(st_file, edit):
    """Rewrite one safetensors file with ``edit(tensors)`` applied (the weights of a tiny test model)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(st_file)
    edit(tensors)
    save_file(tensors, st_file, metadata={"format": "pt"})


def test_a_faithful_export_passes_with_kl_zero_and_full_agreement(checkpoints, tmp_path):
    it = _copy(checkpoints["untied"], tmp_path)
    rec = export_iteration(it, ExportRequest(hf_model="test/llama", reasoning=False))
    assert rec["verdict"] == "PASS" and rec["failures"] == [] and rec["file_set_problems"] == []
    assert rec["max_abs_logit_diff"] == 0.0 and rec["kl"] == 0.0 and rec["top1_agreement"] == 1.0
    assert rec["per_prompt_kl"] == [0.0] * 4 and rec["per_prompt_top1_agreement"] == [1.0] * 4
    assert (rec["tolerances_for"], rec["logit_tolerance"], rec["kl_tolerance"], rec["top1_min"]) == (
        "local", 1e-3, 1e-6, 1.0)
    assert read_json(it / "hf" / "verification.json")["verdict"] == "PASS"


def test_a_perturbed_tensor_fails_on_logits_and_kl_and_is_not_published(checkpoints, tmp_path):
    """Noise on one weight matrix of the export: the logits and KL lines name the difference; no hf/ appears."""
    import torch

    it = _copy(checkpoints["untied"], tmp_path)
    tmp_root = it / ".hf.test.tmp"
    _copy_local(it, tmp_root / "hf")

    def perturb(t):
        g = torch.Generator().manual_seed(1)
        w = t["model.layers.0.mlp.down_proj.weight"]
        t["model.layers.0.mlp.down_proj.weight"] = w + 0.5 * torch.randn(w.shape, generator=g)

    _edit_tensors(tmp_root / "hf" / "model.safetensors", perturb)
    with pytest.raises(VerificationFailed) as exc:
        _verify_and_publish(it, tmp_root / "hf", it / "hf", "local", ExportRequest(hf_model="test/llama",
                            reasoning=False, strict=True, atol=None), tmp_root=tmp_root, source_logits=None)
    failures = exc.value.record["failures"]
    assert re.fullmatch(r"logits differ from the source checkpoint by [0-9.e+-]+ \(tolerance 0\.001\)", failures[0])
    assert re.fullmatch(r"next-token KL\(source \|\| export\) is [0-9.e+-]+ \(tolerance 1e-06\)", failures[1])
    assert exc.value.record["kl"] > 1e-6 and exc.value.record["max_abs_logit_diff"] > 1e-3
    assert not (it / "hf").exists() and not tmp_root.exists()
    assert read_json(it / FAILED)["verdict"] == "FAIL"


def test_a_removed_tensor_fails_the_file_set_naming_it(checkpoints, tmp_path):
    it = _copy(checkpoints["untied"], tmp_path)
    _edit_tensors(it / "model.safetensors", lambda t: t.pop("model.layers.0.mlp.down_proj.weight"))
    with pytest.raises(VerificationFailed) as exc:
        export_iteration(it, ExportRequest(hf_model="test/llama", reasoning=False))
    assert exc.value.record["failures"] == [f"file set: missing tensor model.layers.0.mlp.down_proj.weight "
                                            f"[{HIDDEN}, {INTER}]"]
    assert exc.value.record["decided_on"] == "file set"
    assert not (it / "hf").exists() and not list(it.glob(".hf*"))
    assert read_json(it / FAILED)["file_set_problems"] == exc.value.record["file_set_problems"]


def test_tied_lm_head_may_be_absent_untied_must_be_present(checkpoints, tmp_path, tokenizer):
    import torch

    tied, untied = checkpoints["tied"], checkpoints["untied"]
    with open(tied / "config.json") as f:
        assert json.load(f)["tie_word_embeddings"] is True
    assert file_set_problems(tied) == []  # save_pretrained stores no lm_head.weight for a tied model
    present = _copy(tied, tmp_path / "tied_present")  # a tied model whose exporter stored lm_head anyway
    _edit_tensors(present / "model.safetensors",
                  lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert file_set_problems(present) == []
    assert file_set_problems(untied) == []
    absent = _copy(untied, tmp_path / "untied_absent")
    _edit_tensors(absent / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    assert file_set_problems(absent) == [f"missing tensor lm_head.weight [{len(tokenizer)}, {HIDDEN}] "
                                         "(tie_word_embeddings is false: the output embedding must be stored)"]
    wrong = _copy(untied, tmp_path / "untied_wrong")
    _edit_tensors(wrong / "model.safetensors",
                  lambda t: t.update({"lm_head.weight": torch.zeros(len(tokenizer), HIDDEN + 1)}))
    assert file_set_problems(wrong) == [f"shape mismatch: lm_head.weight is [{len(tokenizer)}, {HIDDEN + 1}], "
                                        f"LlamaForCausalLM expects [{len(tokenizer)}, {HIDDEN}]"]


def test_vocab_rows_unexpected_tensors_and_the_count_of_the_rest(checkpoints, tmp_path, tokenizer):
    """config.vocab_size one more than the embedding's rows, an extra tensor, a config with a second layer: one line
    per problem, the first five shown and the rest counted."""
    import torch

    d = _copy(checkpoints["tied"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": len(tokenizer) + 1}))
    _edit_tensors(d / "model.safetensors", lambda t: t.update({"model.extra.weight": torch.zeros(2, 2)}))
    assert file_set_problems(d) == [
        "unexpected tensor model.extra.weight [2, 2] (not part of LlamaForCausalLM)",
        f"embedding model.embed_tokens.weight has {len(tokenizer)} rows, config.vocab_size is {len(tokenizer) + 1}"]
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    problems = file_set_problems(d)
    assert len(problems) == 10 and problems[0].startswith("missing tensor model.layers.1.")  # 9 + the extra
    assert file_set_failures(problems)[5:] == ["file set: ... and 5 more problem(s) (10 in all)"]


def test_nemotronh_stores_lm_head_even_with_the_tie_flag(tmp_path, tokenizer):
    """NemotronH's config says tie_word_embeddings true, but the class does not tie: lm_head.weight is required."""
    from transformers import AutoModelForCausalLM

    from pipeline.config.models import build_tiny_config, get_model

    conf = build_tiny_config(get_model("tiny-nemotronh-moe"), len(tokenizer), tokenizer.eos_token_id,
                             tokenizer.eos_token_id, tokenizer.bos_token_id)
    AutoModelForCausalLM.from_config(conf).save_pretrained(tmp_path)
    assert file_set_problems(tmp_path) == []
    _edit_tensors(tmp_path / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    assert file_set_problems(tmp_path) == [
        f"missing tensor lm_head.weight [{len(tokenizer)}, 64] (tie_word_embeddings is true, but "
        "NemotronHForCausalLM does not tie it: it must be stored)"]


@pytest.mark.parametrize("rename", [("backbone.", "model."), ("backbone.embeddings.weight", "backbone.embedding.weight")],
                         ids=["in-memory-names", "embedding"])
def test_the_file_set_takes_the_names_transformers_loads(tmp_path, tokenizer, rename):
    """A tensor stored under another name counts as the expected one exactly when transformers' own loader renames
    it onto the same parameter (the Hub's NemotronH checkpoints and transformers' saves name the embedding
    differently across versions): the file set agrees with from_pretrained's own loading report, either way."""
    from transformers import AutoModelForCausalLM

    from pipeline.config.models import build_tiny_config, get_model

    conf = build_tiny_config(get_model("tiny-nemotronh-moe"), len(tokenizer), tokenizer.eos_token_id,
                             tokenizer.eos_token_id, tokenizer.bos_token_id)
    AutoModelForCausalLM.from_config(conf).save_pretrained(tmp_path)
    old, new = rename
    _edit_tensors(tmp_path / "model.safetensors",
                  lambda t: t.update({k.replace(old, new): t.pop(k) for k in [k for k in t if old in k]}))
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    problems = file_set_problems(tmp_path)
    if info["missing_keys"] or info["unexpected_keys"]:  # what transformers does not load stays a problem
        assert problems and all(p.startswith(("missing tensor", "unexpected tensor")) for p in problems), problems
        assert any(new in p for p in problems)
    else:
        assert problems == []


def test_non_finite_logits_are_a_failure_of_their_own_not_a_zero_difference():
    """Logits that are not finite on one side: the comparison counts those positions, reports the difference and
    the KL as NaN (it read 0.0 and full top-1 agreement once), and the failures name the side."""
    import math

    import torch

    from pipeline.checkpoint.verify import compare_logits, fidelity_failures
    from pipeline.config.engines import BF16_TOLERANCES

    torch.manual_seed(0)
    a = torch.randn(1, 4, 16)
    b = a.clone()
    assert fidelity_failures(compare_logits([a], [b]), BF16_TOLERANCES) == []
    b[0, 2, 3] = float("nan")
    cmp = compare_logits([a], [b])
    assert cmp["nonfinite_export"] == 1 and cmp["nonfinite_source"] == 0
    assert math.isnan(cmp["max_abs_logit_diff"]) and cmp["top1_agreement"] == 0.75
    failures = fidelity_failures(cmp, BF16_TOLERANCES)
    assert failures[0] == "the export's logits are not finite at 1 of 4 positions"
    assert any(f.startswith("logits differ from the source checkpoint by nan") for f in failures)


def test_a_weight_bridges_import_leaves_unloaded_refuses_the_import():
    """Bridge's conversion only warns when a Megatron weight gets no Hugging Face tensor (it keeps its random
    initialisation); the suite's import collects those warnings, whatever the logger's level, and refuses."""
    import logging

    from pipeline import bridge
    from pipeline.common.errors import UserError

    logger = logging.getLogger(bridge._CONVERSION_LOGGER)
    logger.setLevel(logging.ERROR)  # as a quiet rank may have it
    with bridge._watch_unloaded_weights() as lines:
        logger.warning("WARNING: Can't find backbone.embeddings.weight in hf_keys")
        logger.warning("WARNING: something else")
    assert lines == ["Can't find backbone.embeddings.weight in hf_keys"] and logger.level == logging.ERROR
    bridge._refuse_unloaded("m", [])  # nothing unloaded: nothing refused
    with pytest.raises(UserError, match=r"^m: Megatron Bridge found no Hugging Face tensor for 1 Megatron weight"):
        bridge._refuse_unloaded("m", lines)
    logger.setLevel(logging.NOTSET)
