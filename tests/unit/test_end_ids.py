"""The ids a generation stops on, one rule for the hf and the megatron backends (issue 47, item 2): a model whose
generation_config.json lists two end ids, neither of them the tokenizer's eos, stops on them in both backends (the
megatron backend stopped only on the tokenizer's eos and ran every answer to --max-tokens)."""

from __future__ import annotations

import ast
import inspect
import json
import textwrap

import pytest

from pipeline import bridge
from pipeline.coherence import backends
from pipeline.common.eos import end_ids

GEN_EOS = [0, 3]  # <|endoftext|> and another token: neither is SmolLM2's tokenizer eos (<|im_end|>, 2)
CONFIG_EOS = 4    # config.json's, read only when the generation config names none


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer):
    """A 1-layer Llama with SmolLM2's tokenizer whose output layer is zero: every logit ties, so greedy decoding
    always picks token 0, one of the generation config's end ids."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    assert tokenizer.eos_token_id not in GEN_EOS
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=CONFIG_EOS, bos_token_id=tokenizer.bos_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.generation_config = GenerationConfig(eos_token_id=GEN_EOS, bos_token_id=tokenizer.bos_token_id)
    path = tmp_path_factory.mktemp("end_ids") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == GEN_EOS
    return path


def test_end_ids_are_the_generation_configs_and_the_tokenizers(tiny_model, tokenizer, tmp_path):
    eos = tokenizer.eos_token_id
    assert end_ids(tiny_model, tokenizer) == {*GEN_EOS, eos}
    assert end_ids(str(tiny_model), tokenizer) == {*GEN_EOS, eos}
    one = tmp_path / "one"  # eos_token_id as an int
    one.mkdir()
    (one / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert end_ids(one, tokenizer) == {3, eos}
    (one / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))  # none named: config.json's
    (one / "config.json").write_text(json.dumps({"eos_token_id": CONFIG_EOS}))
    assert end_ids(one, tokenizer) == {CONFIG_EOS, eos}
    (one / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [5, 6]}}))  # a composite model's
    assert end_ids(one, tokenizer) == {5, 6, eos}
    assert end_ids(tmp_path / "none", tokenizer) == {eos}  # no files: the tokenizer's alone
    assert end_ids("no-such-org/no-such-model", tokenizer) == {eos}  # a hub id offline and not cached


def test_the_hf_backend_stops_on_the_generation_configs_end_ids(tiny_model):
    (text, n, finished, *_), = backends.hf_generate(str(tiny_model), ["Say hi."], 8, reasoning=False)
    assert (n, finished) == (1, True), (text, n, finished)  # token 0, an end id of the generation config


def test_the_megatron_backend_stops_where_the_hf_backend_does(tiny_model, tokenizer):
    import torch

    ids = torch.tensor([[tokenizer.bos_token_id]])
    stop = end_ids(tiny_model, tokenizer)  # what bridge.generate computes for this model
    for end in (*GEN_EOS, tokenizer.eos_token_id):
        assert bridge.greedy_decode(lambda _ids, t=end: t, ids, 8, stop) == ([], True)
    steps = iter([7, 9, 3, 11])
    assert bridge.greedy_decode(lambda _ids: next(steps), ids, 8, stop) == ([7, 9], True)
    assert bridge.greedy_decode(lambda _ids: 7, ids, 3, stop) == ([7, 7, 7], False)  # ran to max_tokens


def _calls(fn) -> dict[str, list[ast.Call]]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    found: dict[str, list[ast.Call]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            found.setdefault(name, []).append(node)
    return found


def test_both_backends_take_their_end_ids_from_one_function():
    hf, meg = _calls(backends.hf_generate), _calls(bridge.generate)
    assert [ast.unparse(c) for c in hf.get("end_ids", [])] == ["end_ids(model_path, tok)"]
    assert [ast.unparse(c) for c in meg.get("end_ids", [])] == ["end_ids(hf_model, tok)"]
    assert backends.end_ids is end_ids and bridge.end_ids is end_ids
    # the megatron loop stops on that set, not on the tokenizer's eos alone
    (decode,) = meg["greedy_decode"]
    assert ast.unparse(decode.args[-1]) == "stop"
    assert "eos_token_id" not in inspect.getsource(bridge.generate)
