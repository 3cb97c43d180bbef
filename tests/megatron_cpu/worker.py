"""The megatron_cpu tier's worker: runs INSIDE the Bridge harness venv (tests/bridge/setup_env.sh) with
PYTHONPATH = tests/megatron_cpu/standin (the tier's CUDA stand-in, chaining the harness's import shim) + src.

    python worker.py make-model OUT          a tiny Llama (Bridge's LlamaBridge maps megatron-core's local layer
                                             names) + a byte-level BPE tokenizer with a ChatML template, and the
                                             Hugging Face greedy tokens of PROMPTS (OUT/hf_greedy.json)
    python worker.py make-nemotron-h OUT     a tiny NemotronH (the Nano pattern's layer kinds: Mamba-2, attention,
                                             MoE; the same tokenizer) and its Hugging Face greedy tokens
    python worker.py import HF OUT           pipeline.bridge.import_from_hf (AutoBridge.import_ckpt)
    python worker.py chat OUT.jsonl          the chat conversations the SFT job's packs are made from
    python worker.py sft DATA HF MEG RUN [OVERRIDE...]
                                             the Nano quickstart shrunk to the tiny model, planned and launched
                                             once on this machine's GPUs (the GPU check's SFT case)
    python worker.py shrunk-rank HF --run-dir DIR
                                             one rank of the user's training job (pipeline.training.run, the
                                             rank entry point the launcher starts) with only the model shrunk to
                                             the tiny model at HF (shrink_model): Bridge's finetune()/pretrain()
    python worker.py generate ITER HF N TP PP EP OUT.json
                                             pipeline.bridge.generate (one rank, or every rank under torchrun)
    python worker.py perturb ITER [FQN]      one shard of a torch_dist checkpoint changed in place (or the tensor FQN)
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


def make_tokenizer(out: Path):
    """A byte-level BPE tokenizer trained on CORPUS with a ChatML template, saved to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    return tok


def write_greedy(model, tok, out: Path) -> None:
    """Hugging Face greedy generation of PROMPTS (chat-templated) by ``model``: OUT/hf_greedy.json."""
    import torch

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


def make_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(out)
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
    write_greedy(model, tok, out)


# The Nano pattern's layer kinds, one each and a second Mamba (NemotronH's hybrid_override_pattern "M*ME"): Mamba-2
# mixer, attention, Mamba-2, MoE (4 routed experts, 2 per token, a shared expert; Nano's sigmoid router with its
# expert bias). Mamba heads 8 x 16 in 2 groups, state 16. The scan's chunk is Nano's, 128, longer than every
# sequence the tier compares with Hugging Face: transformers 5.12.1 (Bridge 0.6.2's upper pin) computes NemotronH's
# pure-torch scan, its only path on a CPU, wrongly across chunks (its output depends on chunk_size; 5.24 fixed it).
NEMOTRON_H_LAYERS = ["mamba", "attention", "mamba", "moe"]


def make_nemotron_h(out: Path) -> None:
    """A tiny NemotronH written as the Hub's NVIDIA checkpoints are (``backbone.embeddings.weight``, what Bridge's
    NemotronHBridge maps: transformers 5.12's save_pretrained writes ``backbone.embedding.weight``, which its loader
    renames back and Bridge's import does not find), then read back by transformers for the greedy tokens."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import NemotronHConfig, NemotronHForCausalLM

    tok = make_tokenizer(out)
    torch.manual_seed(1234)
    cfg = NemotronHConfig(vocab_size=-(-len(tok) // 64) * 64, hidden_size=64, layers_block_type=NEMOTRON_H_LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                          mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, expand=2,
                          chunk_size=128, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=64,
                          moe_shared_expert_intermediate_size=64, num_experts_per_tok=2, use_mamba_kernels=False,
                          initializer_range=0.25, tie_word_embeddings=False, max_position_embeddings=256,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    NemotronHForCausalLM(cfg).save_pretrained(out)
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
    save_file(tensors, weights, metadata={"format": "pt"})
    model = NemotronHForCausalLM.from_pretrained(out).eval()
    assert torch.equal(model.get_input_embeddings().weight, tensors["backbone.embeddings.weight"])
    write_greedy(model, tok, out)


def perturb(iter_dir: Path, fqn: str | None = None) -> None:
    """Bytes of a shard broken in place: a bit of the exponent flipped in 4 KiB of the middle of the largest
    ``*.distcp`` (tensor bytes there: DCP writes tensors raw), or, given ``fqn``, in 1 KiB of the middle of that
    tensor's item (its last, where it is stored in shards), found in the checkpoint's DCP metadata. The checkpoint still loads, with broken weights (values
    2^64 times off, some no longer finite)."""
    if fqn is None:
        shard = max(iter_dir.glob("*.distcp"), key=lambda f: f.stat().st_size)
        start, end, span = 0, shard.stat().st_size, 4096
    else:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(iter_dir)).read_metadata().storage_data
        items = sorted((tuple(idx.offset), info) for idx, info in storage.items() if idx.fqn == fqn)
        if not items:
            raise SystemExit(f"{fqn}: no such tensor in {iter_dir}'s metadata")
        item = items[-1][1]  # the last shard (of stacked experts: the last expert, on the last EP rank)
        shard, start, end, span = iter_dir / item.relative_path, item.offset, item.offset + item.length, 1024
    data = bytearray(shard.read_bytes())
    mid = (start + end) // 2 - span // 2
    for i in range(mid, mid + span):
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


# What of the user's model section is not copied onto a tiny model without experts (the tiny Llama): the MoE
# settings. A tiny model with experts (the tiny NemotronH, the tier's finetune() case) takes them all.
NOT_COPIED = ("moe_",)


def shrink_model(container, cfg, hf: str) -> dict:
    """The user's ConfigContainer with only the model shrunk: Bridge's provider of the tiny model at ``hf`` (the tiny
    NemotronH through NemotronHBridge, or the tiny Llama through LlamaBridge: what the tier's conversion tests run)
    in place of the recipe's, carrying every model setting the user's config sets (layout, sequence length,
    recompute, and the MoE ones where the tiny model has experts, else not: NOT_COPIED), and its tokenizer (the data
    was packed with it).
    Where megatron-core has no TE or Apex FusedAdam (here), the distributed optimizer and its overlapped parameter
    gather are off by the product's own rule (pipeline.bridge.NO_FUSED_ADAM: its torch-Adam fallback cannot resume;
    the cluster's image has TE). Returns what it did, for the test to read."""
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge

    from pipeline import bridge

    ours = bridge.bridge_overrides(cfg).get("model", {})
    provider = AutoBridge.from_hf_pretrained(hf).to_megatron_provider(load_weights=False)
    copied = {}
    skip = () if getattr(provider, "num_moe_experts", None) else NOT_COPIED
    for key, value in ours.items():
        if not key.startswith(skip) and hasattr(provider, key):
            setattr(provider, key, value)
            copied[key] = value
    replaced = type(container.model).__name__
    container.model = provider
    container.tokenizer.tokenizer_model = hf
    dist_opt = bool(container.optimizer.use_distributed_optimizer)
    if dist_opt and not bridge.fused_adam_available():
        # with the distributed optimizer goes its overlapped parameter all-gather (the recipe's DDP turns it on;
        # without the distributed optimizer megatron-core takes a layer-wise gather path that fails at step 1)
        for section in (container.ddp, container.optimizer):
            section.use_distributed_optimizer = section.overlap_param_gather = False
    return {"replaced": replaced, "model": type(provider).__name__, "copied": copied,
            "distributed_optimizer_off": dist_opt and not container.optimizer.use_distributed_optimizer}


def shrunk_rank(hf: str, rest: list[str]) -> int:
    """pipeline.training.run's main on this rank, build_config's container shrunk by shrink_model; rank 0 writes what
    the shrink did to <run_dir>/shrunk.json."""
    from pipeline import bridge
    from pipeline.training import run

    build = bridge.build_config

    def build_shrunk(cfg, *args, **kwargs):
        container = build(cfg, *args, **kwargs)
        done = shrink_model(container, cfg, hf)
        run_dir = Path(os.environ["PIPELINE_RUN_DIR"])
        if int(os.environ.get("RANK", "0")) == 0:
            (run_dir / "shrunk.json").write_text(json.dumps(done, default=str))
        return container

    bridge.build_config = build_shrunk
    _record_first_batch(Path(os.environ["PIPELINE_RUN_DIR"]))
    return run.main(rest)


def _record_first_batch(run_dir: Path) -> None:
    """What Bridge's GPT step hands the model for this rank's first micro-batch (gpt_step.get_batch, read after it
    returns: the tokens, the loss mask and the packed boundaries, cu_seqlens), to <run_dir>/first_batch_rank<R>.json.
    Observation only: the values are returned unchanged."""
    import megatron.bridge.training.gpt_step as step

    get_batch, rank = step.get_batch, int(os.environ.get("RANK", "0"))
    out = run_dir / f"first_batch_rank{rank}.json"

    def recorded(*args, **kwargs):
        batch = get_batch(*args, **kwargs)
        if not out.exists():
            tokens, _labels, loss_mask, _mask, positions, packed = batch
            meta = {k: v.flatten().tolist() for k, v in (packed or {}).items() if hasattr(v, "flatten")}
            out.write_text(json.dumps({"tokens": tokens.flatten().tolist(), "loss_mask": loss_mask.flatten().tolist(),
                                       "position_ids": positions.flatten().tolist(), "packed": meta}))
        return batch

    step.get_batch = recorded


def packed_attention(out: Path) -> None:
    """megatron-core's DotProductAttention (the local spec's core attention) on packed THD input, as the tier's
    stand-in computes it, against the same attention run on each document alone: the largest difference over the
    real tokens of every document (with padding slots between them, as pad_seq_to_mult makes)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from pipeline import bridge

    bridge._init_model_parallel(1, 1, 1)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            attention_dropout=0.0, masked_softmax_fusion=False, bias_dropout_fusion=False)
    attn = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    torch.manual_seed(0)
    starts, lengths, t = [0, 16], [5, 3], 32  # two documents of 5 and 3 tokens, each padded to a slot of 16
    q, k, v = torch.randn(t, 4, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 19], dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor([0, 5, 19], dtype=torch.int32), cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=16, max_seqlen_kv=16)
    packed = attn(q, k, v, None, packed_seq_params=params).reshape(t, -1)
    diffs = []
    for s, n in zip(starts, lengths):
        alone = attn(q[s:s + n].unsqueeze(1), k[s:s + n].unsqueeze(1), v[s:s + n].unsqueeze(1), None).reshape(n, -1)
        diffs.append(float((packed[s:s + n] - alone).abs().max()))
    # and a wrong boundary shows: one document of 19 tokens attends across the boundary the packs keep
    merged = attn(q[:19].unsqueeze(1), k[:19].unsqueeze(1), v[:19].unsqueeze(1), None).reshape(19, -1)
    out.write_text(json.dumps({"diffs": diffs, "across": float((packed[16:19] - merged[16:19]).abs().max())}))


# ---- the Nano quickstart's SFT job, shrunk to the tiny model (the tier's finetune() case; the GPU check's SFT case) --
QUICKSTART = "configs/quickstart/nemotron_nano_quickstart_sft.yaml"
SFT_SEQ, SFT_ITERS, SFT_PAD = 256, 4, 16  # the packs' length; a few steps; the quickstart's pad multiple, as shipped


def chat_jsonl(path: Path, n: int = 2000) -> Path:
    """Chat conversations of varied lengths (several fit in one pack of SFT_SEQ tokens)."""
    import random

    rnd = random.Random(0)
    words = ("the quick brown fox jumps over the lazy dog Paris is the capital of France two plus two is four "
             "write a short poem about the morning light on the water").split()
    with path.open("w") as f:
        for _ in range(n):
            q = " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 20)))
            a = " ".join(rnd.choice(words) for _ in range(rnd.randint(2, 40)))
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    return path


def sft_overrides(data: Path, hf: Path, meg: Path, run_dir: Path, *extra: str, gloo: bool = True,
                  experts: bool = False) -> list[str]:
    """What the machine forces on the quickstart (the model is shrunk by shrink_model in each rank): the packs' length,
    no context parallelism (TE's ring attention), a few steps and one validation iteration (the recipe's 32 take
    minutes on a CPU), our packs and the tiny model's base checkpoint, a save folder, and gloo on a CPU. Expert
    parallelism: 2 (the quickstart's 4 over the 2 ranks there are) with the alltoall token dispatcher (the recipe's
    flex dispatcher is DeepEP's GPU kernels, with no reference to run on a CPU) for a tiny model with ``experts``,
    else 1."""
    moe = ["model.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"] if experts else \
        ["model.expert_model_parallel_size=1"]
    return [f"model.seq_length={SFT_SEQ}", f"dataset.seq_length={SFT_SEQ}",
            f"dataset.offline_packing_specs.packed_sequence_size={SFT_SEQ}",
            f"dataset.offline_packing_specs.tokenizer_model_name={hf.name}", f"dataset.dataset_root={data}",
            "model.context_parallel_size=1", *moe, f"train.train_iters={SFT_ITERS}",
            "validation.eval_iters=1",
            f"checkpoint.pretrained_checkpoint={meg}", f"checkpoint.save={run_dir / 'checkpoints'}",
            f"logger.wandb_save_dir={run_dir / 'wandb'}", *(["+dist.distributed_backend=gloo"] if gloo else []),
            *extra]


def sft_plan(data: Path, hf: Path, meg: Path, run_dir: Path, *extra: str, gloo: bool = True, experts: bool = False):
    """The product's plan of the quickstart (pipeline.cli.train.plan_from_argv) for the selected cluster profile."""
    from pipeline.cli.train import plan_from_argv

    return plan_from_argv([QUICKSTART, "--model", "nano", "--mode", "sft", "--disable-ft", "--nodes", "1",
                           "--run-dir", str(run_dir),
                           *sft_overrides(data, hf, meg, run_dir, *extra, gloo=gloo, experts=experts)])


def sft_launch(p, hf: Path, env: dict, torchrun: list[str], timeout: float = 1500):
    """What pipeline_training_launch.sh does after its preflight (cli/train.py main): the run records, then the plan's
    own launch command, with ``torchrun`` as its launcher and each rank the worker's shrunk-rank
    (pipeline.training.run with the model shrunk). The preflight's one problem must be the memory estimate of the
    model not run (Nano's 31.6B parameters); with it set aside, the view the engines read is built as plan_launch
    builds it once the preflight passes."""
    import dataclasses
    import subprocess

    from pipeline.config.job_env import job_environ
    from pipeline.training import records
    from pipeline.training.views import build_view

    problems = p.preflight.problems
    if len(problems) > 1 or (problems and not problems[0].startswith("estimated memory")):
        raise SystemExit(f"the quickstart's plan was refused: {problems}")
    checked = dataclasses.replace(p.preflight, problems=[])
    records.write_launch_records(Path(p.run_dir), cfg=p.cfg, spec=p.spec, mode="sft", peft=None, cluster=p.cluster,
                                 alloc=p.alloc, nodes=p.nodes, plan=checked, command=["worker.py sft"],
                                 launch_cmd=p.command(), view=build_view(p.cfg, p.spec, "sft", checked))
    cmd = p.command()
    i = cmd.index("-m")
    assert cmd[i + 1] == "pipeline.training.run", cmd
    cmd = [*torchrun, *cmd[1:i], str(Path(__file__).resolve()), "shrunk-rank", str(hf), *cmd[i + 2:]]
    rank_env = job_environ(p.cluster.env, base=env, extra=p.cfg.env_vars)
    rank_env.update(PIPELINE_RUN_DIR=str(p.run_dir), PIPELINE_LAUNCHER="torchrun")
    return subprocess.run(cmd, capture_output=True, text=True, env=rank_env, timeout=timeout)


def sft_job(data: Path, hf: Path, meg: Path, run_dir: Path, extra: list[str]) -> int:
    """worker.py sft DATA HF MEG RUN [OVERRIDE...]: plan and launch the shrunk quickstart once on this machine's
    GPUs (nccl) through torch.distributed.run; its output goes to RUN/launch.log."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.helpers import offline_hf_home

    # the recipe reads Nano's Hugging Face config (AutoBridge.from_hf_pretrained): offline, from the suite's copy
    hf_home = run_dir.parent / "hf_home"
    if not hf_home.is_dir():
        offline_hf_home(hf_home)
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = sft_plan(data, hf, meg, run_dir, *extra, gloo=False)
    r = sft_launch(p, hf, env, [sys.executable, "-m", "torch.distributed.run"])
    Path(run_dir, "launch.log").write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    return r.returncode


def main(argv: list[str]) -> int:
    cmd = argv[0]
    if cmd == "make-model":
        make_model(Path(argv[1]))
    elif cmd == "make-nemotron-h":
        make_nemotron_h(Path(argv[1]))
    elif cmd == "import":
        from pipeline import bridge

        bridge.import_from_hf(argv[1], Path(argv[2]))
    elif cmd == "chat":
        chat_jsonl(Path(argv[1]))
    elif cmd == "sft":
        return sft_job(Path(argv[1]), Path(argv[2]), Path(argv[3]), Path(argv[4]), argv[5:])
    elif cmd == "packed-attention":
        packed_attention(Path(argv[1]))
    elif cmd == "shrunk-rank":
        return shrunk_rank(argv[1], argv[2:])
    elif cmd == "make-lora":
        make_lora(Path(argv[1]), argv[2], Path(argv[3]))
    elif cmd == "generate":
        from pipeline import bridge

        it, hf, n, tp, pp, ep, out = argv[1:8]
        res = bridge.generate(Path(it), hf, PROMPTS, int(n), tp=int(tp), pp=int(pp), ep=int(ep), reasoning=False)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(out).write_text(json.dumps([{"text": t, "n": k, "finished": f} for t, k, f in res]))
    elif cmd == "perturb":
        perturb(Path(argv[1]), argv[2] if len(argv) > 2 else None)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
