"""Numerical verification of an exported Hugging Face checkpoint.

Conversion fidelity decides the verdict:
  0. file set: the export's tensors (safetensors headers only) are exactly the names and shapes the architecture of
     its ``config.json`` expects (``file_set_problems``), checked first, before any weight is loaded;
  1. logits: on a fixed prompt set the exported model's next-token distributions match the source checkpoint's:
     max absolute logit difference within ``atol``, mean KL(source || export) within ``kl_tol``, and the argmax
     agreeing on at least ``top1_min`` of the positions (all compared in float32; ``compare_logits``);
  2. weights: no weight matrix is all zeros or non-finite (a broken file, not a young model).
The tolerances depend on the precision of the comparison (``default_tolerances``): the local engine compares fp32
with fp32 through the same code (measured difference 0.0), a Megatron export compares bf16 Megatron with bf16
Hugging Face; the bf16 defaults come from ``bench/bench_bf16_tolerance.py`` (docs/benchmarks.md).
Model quality is reported, and fatal only with ``require_quality`` (``--require-quality``): an early checkpoint of
a from-scratch run is a faithful conversion of a model that has not learned much yet (a perfect 16-iteration
export, logit difference 0.0, used to FAIL on its reference loss):
  3. the mean next-token loss on fixed reference text against a uniform guess, ln(vocab);
  4. a short greedy generation for each prompt is non-empty.
The verdict and every number are returned as a dict (written next to the export by the caller).
"""

from __future__ import annotations

import gc
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pipeline import bridge
from pipeline.common import layout
from pipeline.common.errors import UserError
from pipeline.common.io import read_json, write_json
from pipeline.config.engines import FP32_TOLERANCES, Tolerances, engine_of_checkpoint

VERIFY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, there was a",
]
REFERENCE_TEXT = (
    "The sun rises in the east and sets in the west. Water is made of hydrogen and oxygen. "
    "A week has seven days, and a year has twelve months. Paris is the capital of France."
)


# Tolerances, FP32_TOLERANCES (the local engine's) and BF16_TOLERANCES (Megatron's): config/engines.py
FILE_SET_SHOWN = 5  # problems of the file-set check listed one a line; the rest are counted


def default_tolerances(engine: str) -> Tolerances:
    """The tolerances of an export by the engine that wrote its source: ``local`` compares fp32 with fp32,
    ``megatron`` compares bf16 with bf16 (two implementations, so bf16 rounding noise on both sides)."""
    writer = engine_of_checkpoint(engine)
    return writer.export_tolerances if writer is not None else FP32_TOLERANCES


def compare_logits(src: list, exp: list) -> dict[str, Any]:
    """Per prompt and overall: max |logit diff|, mean over positions of KL(source || export) of the next-token
    distributions (float64, so two identical rows give exactly 0), and the fraction of positions whose argmax
    agrees. ``src``/``exp`` are one ``[1, seq, vocab]`` tensor per prompt. Overall KL and agreement pool every
    position; the overall max is the largest per-prompt max. A shape mismatch is reported, not raised. Positions
    whose logits are not all finite are counted for each side (``nonfinite_source``, ``nonfinite_export``): there
    the differences are NaN, never a 0 that reads as agreement."""
    import torch

    per = []
    kl_sum, agree, positions, bad_src, bad_exp = 0.0, 0, 0, 0, 0
    for a, b in zip(src, exp):
        if tuple(a.shape) != tuple(b.shape):
            return {"shape_mismatch": f"source logits {tuple(a.shape)} vs export logits {tuple(b.shape)}",
                    "max_abs_logit_diff": math.inf, "kl": math.inf, "top1_agreement": 0.0, "per_prompt": []}
        a64, b64 = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
        lp, lq = torch.log_softmax(a64, -1), torch.log_softmax(b64, -1)
        kl_rows = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
        fin_a, fin_b = torch.isfinite(a64).all(-1), torch.isfinite(b64).all(-1)
        both = fin_a & fin_b
        same = int(((a64.argmax(-1) == b64.argmax(-1)) & both).sum())
        n = a64.shape[0]
        diff = float((a64 - b64).abs().max()) if bool(both.all()) else math.nan
        per.append({"max_abs_logit_diff": diff, "kl": float(kl_rows.mean()) if bool(both.all()) else math.nan,
                    "top1_agreement": same / n, "positions": n})
        kl_sum += float(kl_rows.sum()) if bool(both.all()) else math.nan
        agree += same
        positions += n
        bad_src += int((~fin_a).sum())
        bad_exp += int((~fin_b).sum())
    diffs = [p["max_abs_logit_diff"] for p in per]
    return {"max_abs_logit_diff": math.nan if any(math.isnan(d) for d in diffs) else max(diffs),
            "kl": kl_sum / positions, "top1_agreement": agree / positions, "positions": positions,
            "nonfinite_source": bad_src, "nonfinite_export": bad_exp, "per_prompt": per}


def fidelity_failures(cmp: dict[str, Any], tol: Tolerances) -> list[str]:
    """One line per tolerance a logits comparison (``compare_logits``) breaks."""
    if "shape_mismatch" in cmp:
        return [f"logits of the source checkpoint and the export have different shapes: {cmp['shape_mismatch']}"]
    out = [f"the {side}'s logits are not finite at {cmp[key]} of {cmp['positions']} positions"
           for side, key in (("source checkpoint", "nonfinite_source"), ("export", "nonfinite_export"))
           if cmp.get(key)]
    d, kl, top1 = cmp["max_abs_logit_diff"], cmp["kl"], cmp["top1_agreement"]
    if not math.isfinite(d) or d > tol.atol:
        out.append(f"logits differ from the source checkpoint by {d:.3g} (tolerance {tol.atol:g})")
    if not math.isfinite(kl) or kl > tol.kl:
        out.append(f"next-token KL(source || export) is {kl:.3g} (tolerance {tol.kl:g})")
    if not top1 >= tol.top1:
        out.append(f"top-1 next token agrees on {top1:.1%} of {cmp['positions']} positions (at least "
                   f"{tol.top1:.1%} required)")
    return out


# ---- the export's file set against its config ---------------------------------------------------------------
def _header_shapes(hf_dir: Path) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Every tensor name and shape of the export's safetensors files, read from their headers only (no weight is
    loaded), with the problems of the files themselves: with ``model.safetensors.index.json`` the files it names
    and each tensor where the index says it is, else every ``*.safetensors`` file of the folder."""
    from safetensors import safe_open

    problems: list[str] = []
    index = hf_dir / "model.safetensors.index.json"
    weight_map: dict[str, str] | None = None
    if index.exists():
        try:
            weight_map = dict(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError):
            return {}, [f"{index.name} is not a valid safetensors index (no weight_map)"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f.name for f in hf_dir.glob("*.safetensors"))
    if not files:
        return {}, ["the export has no safetensors weight files"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        try:
            with safe_open(str(hf_dir / name), "pt") as f:
                for key in f.keys():
                    if key in shapes:
                        problems.append(f"tensor {key} is stored twice (again in {name})")
                    elif weight_map is not None and weight_map.get(key) != name:
                        problems.append(f"tensor {key} is in {name}, but {index.name} says "
                                        f"{weight_map.get(key) or 'nothing'}")
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except Exception as exc:  # a missing or corrupt file is one line, whatever the reader raised
            problems.append(f"{name} cannot be read as safetensors ({type(exc).__name__}: {exc})".splitlines()[0])
    if weight_map is not None:
        listed_only = sorted(k for k, f in weight_map.items() if k not in shapes and (hf_dir / f).exists())
        problems += [f"tensor {k} is listed in {index.name} but not stored in {weight_map[k]}" for k in listed_only]
    return shapes, problems


def expected_tensors(config) -> tuple[dict[str, tuple[int, ...]], set[str], str | None, str,
                                     Callable[[str], str | None]]:
    """The tensors a Hugging Face checkpoint of ``config``'s architecture holds on disk: the model class built on
    the meta device (no memory), its state dict renamed back to the checkpoint format the way ``save_pretrained``
    does it (transformers 5 stores e.g. MoE experts fused in memory and one tensor per expert on disk). Returns
    (name -> shape, names that may be absent, the input-embedding name, the model class name, and ``loaded_as``:
    a checkpoint name after transformers' own renaming rules, None where from_pretrained would load it nowhere). The
    output embedding may be absent only where the class really ties it to the input embedding: ``tie_word_embeddings``
    true and the class declaring the tie (NemotronH does not, whatever its config says)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
        revert_weight_conversion,
    )

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {id(m): n for n, m in model.named_modules()}
    emb = names[id(model.get_input_embeddings())] + ".weight"
    out_mod = model.get_output_embeddings()
    out = names[id(out_mod)] + ".weight" if out_mod is not None else None
    sd = {k: v for k, v in model.state_dict().items() if k not in set(model._keys_to_ignore_on_save or ())}

    def on_disk(keys: dict) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(keys)).items()}

    expected = on_disk(sd)
    emb_disk = next(iter(on_disk({emb: sd[emb]})))
    optional: set[str] = set()
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    if out is not None and getattr(config, "tie_word_embeddings", False) and out in tied:
        optional.add(next(iter(on_disk({out: sd[out]}))))
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]

    def loaded_as(key: str) -> str | None:
        """``key`` after transformers' renamings, where from_pretrained loads it (renamed, and merged by a
        converter where one applies, into a parameter of the model); None where it loads nowhere."""
        full, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, sd)
        return rename_source_key(key, renamings, [], model.base_model_prefix, sd)[0] if full in sd else None

    return expected, optional, emb_disk, type(model).__name__, loaded_as


def file_set_problems(hf_dir: Path) -> list[str]:
    """Every way the export's tensors differ from what its ``config.json`` architecture expects, one line each:
    a missing tensor, an unexpected one, a shape mismatch, an embedding whose rows are not ``config.vocab_size``,
    and the output embedding's tie rule (``tie_word_embeddings`` true: ``lm_head.weight`` may be absent; false:
    it must be present). Reads safetensors headers only; [] when the file set is exactly right."""
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    try:
        config = AutoConfig.from_pretrained(hf_dir)
    except (OSError, ValueError, KeyError) as exc:
        return [f"config.json of the export cannot be read ({exc})".splitlines()[0]]
    shapes, problems = _header_shapes(hf_dir)
    if not shapes:
        return problems
    expected, optional, emb, cls, loaded_as = expected_tensors(config)
    # a tensor under another name transformers' loader renames onto the same parameter (the Hub's NemotronH
    # checkpoints store backbone.embeddings.weight, transformers 5 saves backbone.embedding.weight; both load):
    # the expected name is taken as the file's
    by_param = {loaded_as(k): k for k in set(expected) - set(shapes)}
    for k in sorted(set(shapes) - set(expected)):
        e = by_param.get(loaded_as(k)) if loaded_as(k) is not None else None
        if e is not None and expected[e] == shapes[k]:
            expected[k] = expected.pop(e)
            if emb == e:
                emb = k
    tie = bool(getattr(config, "tie_word_embeddings", False))
    for k in sorted(set(expected) - set(shapes) - optional):
        why = ""
        if k.endswith("lm_head.weight"):
            why = (" (tie_word_embeddings is false: the output embedding must be stored)" if not tie else
                   f" (tie_word_embeddings is true, but {cls} does not tie it: it must be stored)")
        problems.append(f"missing tensor {k} {list(expected[k])}{why}")
    problems += [f"unexpected tensor {k} {list(shapes[k])} (not part of {cls})"
                 for k in sorted(set(shapes) - set(expected))]
    vocab = getattr(config, "vocab_size", None)
    if emb in shapes and vocab is not None and shapes[emb][0] != vocab:
        problems.append(f"embedding {emb} has {shapes[emb][0]} rows, config.vocab_size is {vocab}")
    problems += [f"shape mismatch: {k} is {list(shapes[k])}, {cls} expects {list(expected[k])}"
                 for k in sorted(set(shapes) & set(expected))
                 if shapes[k] != expected[k] and not (k == emb and vocab is not None and shapes[k][0] != vocab)]
    return problems


def file_set_failures(problems: list[str]) -> list[str]:
    """The first ``FILE_SET_SHOWN`` file-set problems, one a line, then a count of the rest."""
    shown = [f"file set: {p}" for p in problems[:FILE_SET_SHOWN]]
    if len(problems) > FILE_SET_SHOWN:
        shown.append(f"file set: ... and {len(problems) - FILE_SET_SHOWN} more problem(s) "
                     f"({len(problems)} in all)")
    return shown


def weight_problems(model) -> list[str]:
    import torch

    problems = []
    for name, p in model.state_dict().items():
        if not torch.is_floating_point(p) or p.numel() == 0:
            continue
        if p.ndim < 2 and torch.isfinite(p).all():
            continue  # biases, norms and router corrections may legitimately be zero
        if not torch.isfinite(p).all():
            problems.append(f"{name} has non-finite values")
        elif p.numel() > 1 and not p.abs().sum():
            problems.append(f"{name} is all zeros")
    return problems




def logits_for(model, tokenizer, prompts: list[str]):
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = _on(model, tokenizer(p, return_tensors="pt", add_special_tokens=False)["input_ids"])
            out.append(model(input_ids=ids).logits.float().cpu())
    return out


def _on(model, t):
    """``t`` on the device of the model's input embedding (a model on GPUs; a Megatron source moves it itself)."""
    dev = getattr(model, "device", None)
    return t if dev is None else t.to(dev)


def reference_loss(model, tokenizer) -> float:
    import torch

    ids = _on(model, tokenizer(REFERENCE_TEXT, return_tensors="pt", add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int = 16) -> list[str]:
    import torch

    outs = []
    with torch.no_grad():
        for p in prompts:
            enc = {k: _on(model, v) for k, v in tokenizer(p, return_tensors="pt", add_special_tokens=False).items()}
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            outs.append(tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    return outs


def verify(source_model, exported_model, tokenizer, *, atol: float | None = None, kl_tol: float | None = None,
           top1_min: float | None = None, require_quality: bool = False, source_logits: list | None = None,
           engine: str = "local") -> dict[str, Any]:
    """The verdict of one export: fidelity (logits: max diff, KL, top-1; no broken weight) decides, quality is
    reported. ``source_logits`` (one CPU tensor per ``VERIFY_PROMPTS`` entry) stands in for ``source_model`` when
    the source was run, and freed, before the export was loaded (a Megatron source and its export do not fit one
    node's memory together). Tolerances not given default to ``default_tolerances(engine)``."""
    base = default_tolerances(engine)
    tol = Tolerances(atol=base.atol if atol is None else atol, kl=base.kl if kl_tol is None else kl_tol,
                     top1=base.top1 if top1_min is None else top1_min)
    src = source_logits if source_logits is not None else logits_for(source_model, tokenizer, VERIFY_PROMPTS)
    exp = logits_for(exported_model, tokenizer, VERIFY_PROMPTS)
    cmp = compare_logits(src, exp)
    per = cmp["per_prompt"]
    max_diff = cmp["max_abs_logit_diff"]
    vocab = exported_model.config.vocab_size
    uniform = math.log(vocab)
    loss = reference_loss(exported_model, tokenizer)
    gens = greedy(exported_model, tokenizer, VERIFY_PROMPTS)
    weights = weight_problems(exported_model)
    failures, quality = fidelity_failures(cmp, tol), []
    if weights:
        failures.append(f"{len(weights)} bad weight tensor(s): {'; '.join(weights[:3])}")
    if not math.isfinite(loss) or loss > 0.8 * uniform:
        quality.append(f"reference-text loss {loss:.3f} is not well below the uniform-guess loss ln({vocab}) = "
                       f"{uniform:.3f}")
    empty = [p for p, g in zip(VERIFY_PROMPTS, gens) if not g.strip()]
    if empty:
        quality.append(f"empty greedy generation for {len(empty)} of {len(gens)} prompts")
    if require_quality:
        failures += quality
    return {
        "verdict": "PASS" if not failures else "FAIL",
        "failures": failures,
        "decided_on": "fidelity and quality" if require_quality else "conversion fidelity",
        "quality": {"warnings": quality, "fatal": require_quality, "reference_loss": loss, "uniform_loss": uniform},
        "max_abs_logit_diff": max_diff,
        "per_prompt_max_abs_logit_diff": [p["max_abs_logit_diff"] for p in per],
        "logit_tolerance": tol.atol,
        "kl": cmp["kl"],
        "per_prompt_kl": [p["kl"] for p in per],
        "kl_tolerance": tol.kl,
        "top1_agreement": cmp["top1_agreement"],
        "per_prompt_top1_agreement": [p["top1_agreement"] for p in per],
        "top1_min": tol.top1,
        "tolerances_for": engine,
        "reference_loss": loss,
        "uniform_loss": uniform,
        "bad_weights": weights,
        "generations": [{"prompt": p, "generation": g} for p, g in zip(VERIFY_PROMPTS, gens)],
    }


# ---- an export against its source: the export's verification step (checkpoint/export.py runs it) -----------------
FAILED = "hf_verification_FAILED.json"  # beside the iteration, where hf/ would be, when the verification fails
log = logging.getLogger("pipeline.checkpoint.export")  # the export's log: these lines are its steps


class VerificationFailed(Exception):
    def __init__(self, record: dict):
        super().__init__("; ".join(record.get("failures", [])))
        self.record = record


class ExportSettings(Protocol):
    """What the verification reads of an export request (``export.ExportRequest``)."""

    @property
    def hf_model(self) -> str: ...
    @property
    def reasoning(self) -> bool: ...
    @property
    def strict(self) -> bool: ...
    @property
    def require_quality(self) -> bool: ...
    @property
    def atol(self) -> float | None: ...
    @property
    def kl_tol(self) -> float | None: ...
    @property
    def top1_min(self) -> float | None: ...


def free_gpu_memory() -> None:
    """Return freed CUDA memory to the device (after a model is dropped), where CUDA is available."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def megatron_source_logits(iter_path: Path, hf_dir: Path, *, hf_model: str, tp: int = 1, pp: int = 1,
                           ep: int = 1, lora_base: Path | None = None) -> list:
    """The Megatron source's logits on ``VERIFY_PROMPTS``, on CPU, with the model loaded on the export's layout
    (collective: every rank calls it) and freed before returning, so the export can then use the same GPUs."""
    from transformers import AutoConfig, AutoTokenizer

    source = bridge.MegatronCausalLM(iter_path, hf_model, AutoConfig.from_pretrained(hf_dir), tp=tp, pp=pp, ep=ep,
                                     lora_base=lora_base)
    try:
        return logits_for(source.eval(), AutoTokenizer.from_pretrained(hf_dir), VERIFY_PROMPTS)
    finally:
        source.release()
        del source
        free_gpu_memory()


def load_bf16_export(hf_dir: Path):
    """The export in bf16: on GPU 0 when it fits there (weights from the safetensors headers, 25% headroom for
    activations), else spread over the node's GPUs with ``device_map="auto"``; on CPU without CUDA."""
    import torch
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    shapes, _ = _header_shapes(hf_dir)
    need = 2 * sum(math.prod(s) for s in shapes.values())
    free, _total = torch.cuda.mem_get_info(0)
    device_map: Any = {"": 0} if need * 1.25 < free else "auto"
    log.info("export: loading the bf16 export (%.1f GB) %s", need / 1e9,
             "on GPU 0" if device_map != "auto" else f"across {torch.cuda.device_count()} GPUs (device_map=auto)")
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, device_map=device_map)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def tokenizer_missing(hf_dir: Path) -> str | None:
    """Why the export has no tokenizer (its iteration held no tokenizer files), or None."""
    if any((Path(hf_dir) / n).is_file() for n in TOKENIZER_FILES):
        return None
    return ("the export has no tokenizer files (tokenizer.json, tokenizer_config.json): the iteration holds none; "
            "copy the model's tokenizer files into the iteration and export it again")


def chat_template_refusal(tokenizer) -> str | None:
    """Why the tokenizer's chat template cannot render one user turn (what coherence and a chat server send), or
    None: a template that raises had verified PASS and then crashed coherence."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                      tokenize=False)
    except Exception as exc:  # jinja2's TemplateError (raise_exception), or the template's own bug
        return (f"the chat template refuses a conversation of one user turn ({type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:160]}): coherence and chat serving will refuse it too")
    return None


def _fail(iter_path: Path, record: dict) -> None:
    write_json(iter_path / FAILED, record)
    raise VerificationFailed(record)


def verify_export(iter_path: Path, tmp: Path, engine: str, req: ExportSettings, *, source_logits: list | None = None,
                  lora_base: Path | None = None) -> dict[str, Any]:
    """Verify the export in ``tmp`` against its source ``iter_path``: the PASS record; a FAIL writes
    ``hf_verification_FAILED.json`` beside the iteration and raises :class:`VerificationFailed`.

    The file set first (headers only): a missing, unexpected or misshapen tensor fails here, before any model is
    loaded. Megatron: the source's logits first (``source_logits`` when the model-parallel ranks computed them
    already, else one process), the source freed, then the export loaded (:func:`load_bf16_export`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model, reasoning, strict, require_quality = req.hf_model, req.reasoning, req.strict, req.require_quality
    context = {"source": str(iter_path), "engine": engine, "hf_model": hf_model, "reasoning": reasoning,
               "strict": strict, "prompts": VERIFY_PROMPTS}
    if lora_base is not None:  # the export is hf_model + the adapters; the source, the Megatron base + adapters
        context["lora"] = {"base": str(lora_base), "merged_into": hf_model,
                           "source": "Megatron base + Bridge's LoRA transform + the iteration's adapter weights"}
    problems = file_set_problems(tmp)
    if problems:
        _fail(iter_path, {"verdict": "FAIL", "failures": file_set_failures(problems), "decided_on": "file set",
                          "file_set_problems": problems, **context})
    missing = tokenizer_missing(tmp)
    if missing:  # AutoTokenizer made an empty one and the verification died in an IndexError
        _fail(iter_path, {"verdict": "FAIL", "failures": [f"tokenizer: {missing}"], "decided_on": "tokenizer",
                          "file_set_problems": [], **context})
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    template_warning = chat_template_refusal(tokenizer)
    source = None
    writer = engine_of_checkpoint(engine)
    if writer is not None and writer.megatron_checkpoint:
        if source_logits is None:
            source_logits = megatron_source_logits(iter_path, tmp, hf_model=hf_model, lora_base=lora_base)
        exported = load_bf16_export(tmp)
        iteration = layout.iteration_number(iter_path)
        model_name = hf_model
    else:
        marker = read_json(iter_path / layout.MARKER)
        source = AutoModelForCausalLM.from_pretrained(iter_path, dtype=torch.float32).eval()
        exported = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        if strict:
            a, b = set(source.state_dict()), set(exported.state_dict())
            if a != b:
                raise UserError(f"strict export: parameter names differ ({sorted(a ^ b)[:5]}); --not-strict to allow")
        iteration = marker.get("iteration")
        model_name = marker.get("model")
    record = verify(source, exported.eval(), tokenizer, atol=req.atol, kl_tol=req.kl_tol, top1_min=req.top1_min,
                    require_quality=require_quality, source_logits=source_logits, engine=engine)
    if template_warning:  # the weights are verified; what serves them cannot chat: a quality warning, fatal with
        record.setdefault("quality", {}).setdefault("warnings", []).append(template_warning)  # --require-quality
        if require_quality:
            record.setdefault("failures", []).append(template_warning)
            record["verdict"] = "FAIL"
    for w in record.get("quality", {}).get("warnings", []):
        log.warning("export: %s: %s (model quality: reported, not fatal; --require-quality makes it fatal)",
                    iter_path.name, w)
    record.update({**context, "iteration": iteration, "model": model_name, "file_set_problems": []})
    if record["verdict"] != "PASS":
        _fail(iter_path, record)
    return record
