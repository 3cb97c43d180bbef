"""The Megatron Bridge engine (GPU cluster): the ONLY module of the suite that imports ``megatron.bridge``.

Every import of ``megatron.bridge`` happens inside a function, so the rest of the suite imports, runs and
is tested on machines where Megatron Bridge cannot even be imported (it needs Transformer Engine, which
needs CUDA). ``BRIDGE_API`` lists every module, function, class and keyword argument used here;
``tests/unit/test_bridge_conformance.py`` checks each against the source of the pinned wheel
(``3rdparty/megatron-bridge.txt``), parsed, not imported.

What runs here (verified only on a GPU cluster, see docs/decisions.md):
  train              recipe -> ConfigContainer; our resolved YAML + overrides applied with Bridge's own
                     process_config_with_overrides; pretrain() or finetune() with gpt_step.forward_step
  export_checkpoint  AutoBridge.export_ckpt (Megatron -> HF) + logit verification against the Megatron model
  import_checkpoint  AutoBridge.import_ckpt (HF -> Megatron)
  generate           greedy generation from a Megatron checkpoint (coherence backend ``megatron``)
"""

from __future__ import annotations

import importlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pipeline.common.errors import UserError
from pipeline.config.loader import get, strip_suite_only
from pipeline.config.models import get_model

log = logging.getLogger(__name__)

_AB = "megatron.bridge.models.conversion.auto_bridge"
# (module, qualified name, keyword arguments we pass) - checked against the pinned wheel's source.
BRIDGE_API: list[tuple[str, str, tuple[str, ...]]] = [
    ("megatron.bridge.training.pretrain", "pretrain", ("config", "forward_step_func")),
    ("megatron.bridge.training.finetune", "finetune", ("config", "forward_step_func")),
    ("megatron.bridge.training.gpt_step", "forward_step", ()),
    ("megatron.bridge.training.utils.omegaconf_utils", "process_config_with_overrides",
     ("config", "config_filepath", "cli_overrides")),
    ("megatron.bridge.training.config", "ConfigContainer", ()),
    (_AB, "AutoBridge", ()),
    (_AB, "AutoBridge.from_hf_pretrained", ("path",)),
    (_AB, "AutoBridge.import_ckpt", ("hf_model_id", "megatron_path")),
    (_AB, "AutoBridge.export_ckpt", ("megatron_path", "hf_path", "strict")),
    (_AB, "AutoBridge.load_megatron_model", ("path", "mp_overrides")),
    ("megatron.bridge.models.model_provider", "ModelParallelKwargs", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_nano", "nemotron_3_nano_pretrain_config", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_nano", "nemotron_3_nano_sft_config", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_nano", "nemotron_3_nano_peft_config", ("peft_scheme",)),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_super", "nemotron_3_super_pretrain_config", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_super", "nemotron_3_super_sft_config", ()),
    ("megatron.bridge.recipes.nemotronh.nemotron_3_super", "nemotron_3_super_peft_config", ("peft_scheme",)),
]


def _import(module: str, name: str):
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def bridge_overrides_yaml(cfg: dict) -> str:
    """The YAML handed to process_config_with_overrides: our resolved config without suite-only keys and
    without unset values (so the recipe keeps its own)."""
    return yaml.safe_dump(strip_suite_only(cfg), sort_keys=False)


def build_config(cfg: dict, model: str, mode: str, peft: str | None, under_ft_launcher: bool):
    spec = get_model(model)
    recipe = _import(spec.recipe_module, spec.recipe_name(mode, peft))
    container = recipe(peft_scheme=peft) if peft else recipe()
    process = _import("megatron.bridge.training.utils.omegaconf_utils", "process_config_with_overrides")
    extra = []
    if under_ft_launcher:
        extra = ["ft.enable_ft_package=true", "ft.calc_ft_timeouts=true"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(bridge_overrides_yaml(cfg))
        path = f.name
    try:
        return process(config=container, config_filepath=path, cli_overrides=extra)
    finally:
        os.unlink(path)


def train(run_dir: Path, cfg: dict, launch: dict) -> int:
    import time

    from pipeline.common.io import write_text
    from pipeline.training import records

    try:
        importlib.import_module("megatron.bridge")
    except ImportError as exc:
        raise UserError(f"Megatron Bridge cannot be imported here ({exc}); the {launch['model']} model trains on the "
                        "GPU cluster inside the container (PIPELINE_RUNTIME=apptainer)") from None
    under_ft = "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("PIPELINE_LAUNCHER") == "ft_launcher"
    config = build_config(cfg, launch["model"], launch["mode"], launch.get("peft"), under_ft)
    forward_step = _import("megatron.bridge.training.gpt_step", "forward_step")
    if launch["mode"] == "pretrain" and not launch.get("peft"):
        _import("megatron.bridge.training.pretrain", "pretrain")(config=config, forward_step_func=forward_step)
    else:
        _import("megatron.bridge.training.finetune", "finetune")(config=config, forward_step_func=forward_step)
    if int(os.environ.get("RANK", "0")) == 0:
        iters = int(get(cfg, "train.train_iters"))
        write_text(run_dir / records.DONE_MARKER, f"{iters}\n")
        print(records.COMPLETION_LINE.format(now=time.strftime("%Y-%m-%d %H:%M:%S")), flush=True)
    return 0


def export_checkpoint(iter_path: Path, out: Path, *, hf_model: str, reasoning: bool, strict: bool,
                      atol: float) -> dict[str, Any]:
    """Megatron iteration -> HF with AutoBridge.export_ckpt, verified against the Megatron model's logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.checkpoint.export import VerificationFailed, _apply_reasoning
    from pipeline.checkpoint.verify import VERIFY_PROMPTS, verify
    from pipeline.common.io import atomic_path, write_json

    AutoBridge = _import(_AB, "AutoBridge")
    bridge = AutoBridge.from_hf_pretrained(hf_model)
    with atomic_path(out) as tmp:
        bridge.export_ckpt(megatron_path=str(iter_path.parent), hf_path=str(tmp), strict=strict)
        _apply_reasoning(tmp, reasoning)
        exported = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, device_map="auto")
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        source = _MegatronAsHF(bridge, iter_path.parent, exported.config)
        record = verify(source, exported, tokenizer, atol=atol)
        record.update({"source": str(iter_path), "engine": "megatron", "hf_model": hf_model, "reasoning": reasoning,
                       "strict": strict, "prompts": VERIFY_PROMPTS})
        if record["verdict"] != "PASS":
            write_json(iter_path / "hf_verification_FAILED.json", record)
            raise VerificationFailed(record)
        write_json(tmp / "verification.json", record)
    return record


class _MegatronAsHF:
    """Just enough of a causal-LM interface over a Megatron model for ``verify.logits_for``."""

    def __init__(self, bridge, ckpt: Path, hf_config):
        self.models = bridge.load_megatron_model(str(ckpt), mp_overrides={"tensor_model_parallel_size": 1},
                                                 wrap_with_ddp=False)
        self.config = hf_config

    def __call__(self, input_ids, labels=None):
        import torch

        m = self.models[0]
        ids = input_ids.cuda()
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        logits = m(input_ids=ids, position_ids=pos, attention_mask=None)

        class _Out:
            pass

        o = _Out()
        o.logits = logits.float().cpu()
        if labels is not None:
            o.loss = torch.nn.functional.cross_entropy(o.logits[0, :-1], labels[0, 1:])
        return o

    def eval(self):
        for m in self.models:
            m.eval()
        return self


def import_checkpoint(hf_id: str, output: Path) -> Path:
    AutoBridge = _import(_AB, "AutoBridge")
    AutoBridge.import_ckpt(hf_model_id=hf_id, megatron_path=str(output))
    return output


def generate(ckpt: str, hf_model: str, prompts: list[str], max_tokens: int, *, tp: int, pp: int, ep: int,
             reasoning: bool):
    """Greedy generation straight from a Megatron checkpoint (one rank per GPU under torchrun)."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.checkpoint import layout

    AutoBridge = _import(_AB, "AutoBridge")
    bridge = AutoBridge.from_hf_pretrained(hf_model)
    path = Path(ckpt)
    if (path / layout.TRACKER).exists():
        path = layout.resolve_iteration(path, None).parent
    models = bridge.load_megatron_model(str(path), mp_overrides={"tensor_model_parallel_size": tp,
                                                                 "pipeline_model_parallel_size": pp,
                                                                 "expert_model_parallel_size": ep},
                                        wrap_with_ddp=False)
    model = models[0].eval()
    tok = AutoTokenizer.from_pretrained(hf_model)
    out = []
    for prompt in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", enable_thinking=reasoning).cuda()
        new: list[int] = []
        with torch.no_grad():
            for _ in range(max_tokens):
                pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
                nxt = int(model(input_ids=ids, position_ids=pos, attention_mask=None)[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                new.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]], device=ids.device)], dim=1)
        out.append((tok.decode(new, skip_special_tokens=True).strip(), len(new), len(new) < max_tokens))
    return out
