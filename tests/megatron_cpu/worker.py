"""The megatron_cpu tier's worker: runs INSIDE the Bridge harness venv (tests/bridge/setup_env.sh) with
PYTHONPATH = tests/megatron_cpu/standin (the tier's CUDA stand-in, chaining the harness's import shim) + src.

    python worker.py make-model OUT          a tiny Llama (Bridge's LlamaBridge maps megatron-core's local layer
                                             names) + a byte-level BPE tokenizer with a ChatML template, and the
                                             Hugging Face greedy tokens of PROMPTS (OUT/hf_greedy.json)
    python worker.py import HF OUT           pipeline.bridge.import_from_hf (AutoBridge.import_ckpt)
    python worker.py generate ITER HF N TP PP EP OUT.json
                                             pipeline.bridge.generate (one rank, or every rank under torchrun)
    python worker.py perturb ITER            one shard of a torch_dist checkpoint changed in place
    python worker.py make-lora BASE_ITER HF OUT
                                             a Bridge LoRA checkpoint OUT/iter_0000002 on the imported base: the
                                             base loaded with Bridge, Bridge's LoRA transform, nonzero adapter
                                             weights, saved as Bridge's PEFT save does (the adapter-only state dict
                                             through dist_checkpointing; run_config.yaml with peft: and
                                             checkpoint.pretrained_checkpoint); the Megatron base + adapters' logits
                                             on PROMPTS[0] in OUT/lora_logits.pt
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "What is 2 + 2?"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. The sea is wide and deep. "
          "Two plus two is four. Write a short poem about the morning light on the water. ") * 40


def make_model(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=384, special_tokens=specials,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(out)
    torch.manual_seed(1234)
    # peaky logits (a wide init) so greedy argmaxes are far from ties: the layouts' different summation orders
    # must not flip a token
    cfg = LlamaConfig(vocab_size=-(-len(tok) // 64) * 64,  # padded, as real vocabularies are (tp must divide it)
                      hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.25, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    greedy = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=int(os.environ.get("TIER_MAX_TOKENS", "12")), do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        new = g[0, ids.shape[1]:].tolist()
        finished = bool(new) and new[-1] == tok.eos_token_id
        if finished:
            new = new[:-1]
        greedy.append({"prompt": p, "tokens": new, "text": tok.decode(new, skip_special_tokens=True).strip(),
                       "finished": finished})
    (out / "hf_greedy.json").write_text(json.dumps(greedy, indent=1))


def perturb(iter_dir: Path) -> None:
    """One shard changed in place: a bit of the exponent flipped in 4 KiB of the middle of the largest ``*.distcp``
    (tensor bytes there: DCP writes tensors raw), so the checkpoint still loads, with wrong weights."""
    shard = max(iter_dir.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 4096):
        data[i] ^= 0x40
    shard.write_bytes(bytes(data))


LORA_ITERATION = 2


def make_lora(base_iter: Path, hf: str, out: Path) -> None:
    import torch
    import yaml
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.training.checkpointing import (
        _generate_model_state_dict,
        apply_peft_adapter_filter_to_state_dict,
    )
    from megatron.bridge.training.config import ConfigContainer, TrainingConfig
    from megatron.bridge.utils.yaml_utils import safe_yaml_representers
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig, AutoTokenizer

    from pipeline import bridge as pb

    pb._init_model_parallel(1, 1, 1)
    models = AutoBridge.from_hf_pretrained(hf).load_megatron_model(str(base_iter), wrap_with_ddp=False)
    lora = LoRA(dim=8, alpha=16)
    models = lora(models, training=False)
    torch.manual_seed(7)
    adapters = [(n, p) for n, p in models[0].named_parameters() if ".adapter." in n]
    assert adapters, "Bridge's LoRA matched no module"
    with torch.no_grad():
        for _, p in adapters:  # lora_B starts at zero: both nonzero, so base + adapters differs from the base
            p.normal_(0.0, 0.2)
    target = out / f"iter_{LORA_ITERATION:07d}"
    target.mkdir(parents=True, exist_ok=True)
    sharded = apply_peft_adapter_filter_to_state_dict(_generate_model_state_dict(models, {}), lora)
    dist_checkpointing.save(sharded, str(target))
    cfg = yaml.safe_load((base_iter / "run_config.yaml").read_text())  # the base's, as Bridge wrote it
    cfg["peft"] = ConfigContainer._convert_value_to_dict(lora)
    cfg["train"] = ConfigContainer._convert_value_to_dict(TrainingConfig(train_iters=LORA_ITERATION))
    cfg["checkpoint"].update(pretrained_checkpoint=str(base_iter.parent), save=str(out), finetune=True)
    with safe_yaml_representers():
        (target / "run_config.yaml").write_text(yaml.safe_dump(cfg, default_flow_style=False))
    (out / "latest_checkpointed_iteration.txt").write_text(f"{LORA_ITERATION}\n")
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    models[0].eval()
    with torch.no_grad():
        logits = models[0](input_ids=ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0), attention_mask=None)
    vocab = AutoConfig.from_pretrained(hf).vocab_size  # Megatron pads the vocabulary further
    torch.save({"input_ids": ids, "logits": logits[..., :vocab].float()}, out / "lora_logits.pt")


def main(argv: list[str]) -> int:
    cmd = argv[0]
    if cmd == "make-model":
        make_model(Path(argv[1]))
    elif cmd == "import":
        from pipeline import bridge

        bridge.import_from_hf(argv[1], Path(argv[2]))
    elif cmd == "make-lora":
        make_lora(Path(argv[1]), argv[2], Path(argv[3]))
    elif cmd == "generate":
        from pipeline import bridge

        it, hf, n, tp, pp, ep, out = argv[1:8]
        res = bridge.generate(Path(it), hf, PROMPTS, int(n), tp=int(tp), pp=int(pp), ep=int(ep), reasoning=False)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(out).write_text(json.dumps([{"text": t, "n": k, "finished": f} for t, k, f in res]))
    elif cmd == "perturb":
        perturb(Path(argv[1]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
