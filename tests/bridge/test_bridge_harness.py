"""Bridge harness: the project's real code on Megatron Bridge 0.6.2's REAL code, on CPU.

The pytest process runs in the project's venv (transformers 5.24, where Bridge cannot import); every check
runs in the harness venv built by tests/bridge/setup_env.sh (Python 3.11, CPU torch 2.13, megatron-bridge
0.6.2, megatron-core 0.19.2, transformers 5.12.1) through tests/bridge/driver.py (JSON in, JSON out), with
PYTHONPATH = tests/bridge/shim (an import shim, declared as such: no assertion here rests on it) + src.

Hugging Face configs (no download is possible): tests/assets/hf_configs/<org>--<name>/config.json is laid out
as an offline HF hub cache under a temp HF_HOME (HF_HUB_OFFLINE=1), so the recipes'
AutoBridge.from_hf_pretrained("nvidia/...") finds them. Both are transformers NemotronHConfig (model_type
nemotron_h: hybrid Mamba-2 / attention / MoE), written with transformers 5.12.1:
  - Nano 30B-A3B: the flagship's dimensions as Bridge 0.6.2 itself states them in
    recipes/nemotronh/h100/nemotron_3_nano.py (nemotron_3_nano_pretrain_8gpu_h100_bf16_config): pattern
    MEMEM*EMEMEM*... (52 layers), hidden 2688, 32 heads / 2 KV groups, head_dim 128, Mamba 64 heads x 64,
    state 128, 8 groups, 128 experts top-6 (scaling 2.5), expert FFN 1856, shared expert 3712, vocab 131072.
  - Super 120B-A12B: same architecture family, REDUCED dimensions (Bridge's source carries no Super
    numbers: its recipe reads them from the HF config): 12 layers MEM*EMEM*EME, hidden 1024, 16 experts
    top-4, LatentMoE (moe_latent_size 256) like the flagship. Enough for the config path; not the real size.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import offline_hf_home
from tests.tiers import tier_unavailable

pytestmark = [pytest.mark.bridge, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("PIPELINE_ROOT", ROOT)) / ".cache" / "bridge-venv"
QUICKSTART = "configs/quickstart/nemotron_nano_quickstart_sft.yaml"
SAVE = "/scratch/team/checkpoints/nano_quickstart"  # not checked (--no-path-checks): a plan only
CASES = [(m, mode, peft) for m in ("nano", "super")
         for mode, peft in (("pretrain", None), ("cpt", None), ("sft", None), ("sft", "lora"))]
SFT_ONLY_DATASET_KEYS = {"dataset.dataset_root", "dataset.offline_packing_specs.packed_sequence_size",
                         "dataset.offline_packing_specs.pad_seq_to_mult",
                         "dataset.offline_packing_specs.tokenizer_model_name"}
# Super's recipe sets no layout the quickstart's 4-GPU fabric accepts; these make a plan the preflight passes.
SUPER_OVERRIDES = ["model.tensor_model_parallel_size=1", "model.pipeline_model_parallel_size=8",
                   "model.expert_model_parallel_size=4", "model.context_parallel_size=1"]


# ---- environment --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """Builds (or reuses) the harness venv, and an offline HF cache holding the shipped configs."""
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(HERE / "setup_env.sh")], capture_output=True, text=True,
                       env={**os.environ, "PIPELINE_ROOT": str(VENV.parents[1])})
    print(r.stdout, r.stderr[-3000:], f"setup_env.sh: {time.monotonic() - t0:.0f} s", sep="\n")
    if r.returncode != 0:
        unreachable = ("No matching distribution" in r.stderr or "Could not find a version" in r.stderr
                       or "NewConnectionError" in r.stderr or "Network is unreachable" in r.stderr)
        if unreachable:
            tier_unavailable("bridge", f"the harness venv cannot be installed (no package registry): "
                                       f"{r.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"tests/bridge/setup_env.sh failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return {"hf_home": offline_hf_home(tmp_path_factory.mktemp("hf_home"))}


def drive(harness, ops: list[dict], timeout: int = 600) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=f"{HERE / 'shim'}{os.pathsep}{ROOT / 'src'}", HF_HOME=str(harness["hf_home"]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([str(VENV / "bin" / "python"), str(HERE / "driver.py")], input=json.dumps({"ops": ops}),
                       capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip(), f"driver failed ({r.returncode}):\n{r.stderr[-6000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])["results"]


def our_config(model: str, mode: str, peft: str | None, config: str = QUICKSTART, overrides=(), nodes: int = 16) -> dict:
    """What the project resolves (the dry run's plan): the login-node preflight must pass it."""
    from pipeline.cli.train import plan_from_argv

    # A save directory, as every run under the profile's ft_launcher needs one (the preflight refuses it null)
    save = [] if any(str(o).startswith("checkpoint.save=") for o in overrides) else [f"checkpoint.save={SAVE}"]
    argv = [config, "--model", model, "--mode", mode, "--dry-run", "--no-path-checks", "--nodes", str(nodes),
            *(["--peft", peft] if peft else []), *save, *overrides]
    lp = plan_from_argv(argv)
    assert lp.preflight.ok, lp.preflight.problems
    return lp.cfg.to_dict()  # the config of record (config.yaml): what crosses into the driver as JSON


# ---- a: every shipped config, every Bridge model x mode, through Bridge's recipe + override code -------------
def test_build_config_every_model_and_mode(harness):
    """Our resolved config (plan_from_argv: the dry run's plan, preflight passed) -> pipeline.bridge.build_config
    -> Bridge's recipe ConfigContainer + process_config_with_overrides; every leaf of the YAML our side hands
    Bridge is read back from the container with a getattr chain and must be equal."""
    ops = []
    for model, mode, peft in CASES:
        extra = SUPER_OVERRIDES if model == "super" else []
        if mode in ("pretrain", "cpt"):
            # The quickstart is an SFT config: its packed-SFT dataset keys do not exist on the pretrain recipe's
            # dataset (GPTDatasetConfig), where Bridge's override code would drop them without a word (found by
            # this harness); the login-node preflight now refuses them (test_preflight_refuses_what_bridge_drops).
            # A pretraining run names indexed data instead.
            # (and, with the quickstart's full recompute, no per-module CUDA graphs: the preflight refuses the pair)
            extra = [*extra, "~dataset.dataset_root", "~dataset.offline_packing_specs",
                     "+dataset.data_path=[/data/corpus_text_document]", "model.cuda_graph_impl=none"]
        cfg = our_config(model, mode, peft, overrides=extra)
        ops.append({"op": "build_config", "id": f"{model}/{mode}/{peft}", "cfg": cfg, "model": model, "mode": mode,
                    "peft": peft})
    results = drive(harness, ops)
    assert len(results) == len(CASES)
    for r in results:
        assert "error" not in r, f"{r['id']}: {r['error']} at {r['where']}\n{r.get('trace', '')}"
        assert r["recipe"] == "ConfigContainer"
        model, mode, peft = r["id"].split("/")
        lost = {m["key"] for m in r["mismatches"]}
        assert not lost, f"{r['id']}: values that did not arrive in the ConfigContainer: {r['mismatches']}"
        # packed SFT (and LoRA) data reaches the model with each document's boundaries: Bridge's GPT step builds
        # PackedSeqParams from the collate's cu_seqlens (which test_short_replies_... reads back per document)
        assert r["packed_seq_metadata"] is (mode == "sft"), f"{r['id']}: packed metadata {r['packed_seq_metadata']}"
        # the launcher's Bridge settings arrive too: Megatron's exit-signal handler, and resuming its own save
        for key in ("train.exit_signal_handler",):
            assert key in r["checked"], f"{r['id']}: {key} was not compared"
        # The quickstart's own settings are among those checked (the walk is not vacuous).
        for key in ("model.seq_length", "model.context_parallel_size", "model.expert_model_parallel_size",
                    "train.global_batch_size", "train.train_iters", "optimizer.lr", "dataset.seq_length",
                    "checkpoint.pretrained_checkpoint", "model.recompute_granularity", "logger.wandb_save_dir",
                    *(SFT_ONLY_DATASET_KEYS if mode == "sft" else ("dataset.data_path",))):
            assert key in r["checked"], f"{r['id']}: {key} was not compared"
        assert r["container_types"]["model"] == "HybridModelProvider"
        assert (r["container_types"]["peft"] == "LoRA") == (peft == "lora"), r["container_types"]
        if model == "super":
            assert "model.pipeline_model_parallel_size" in r["checked"]


# ---- Bridge's own validation of every job we ship ----------------------------------------------------------------
PRETRAIN_DATA = ["+dataset.data_path=[/data/corpus_text_document]"]
NOT_SFT = ["~dataset.dataset_root", "~dataset.offline_packing_specs", *PRETRAIN_DATA]
SUPER_QS = "configs/quickstart/nemotron_super_quickstart_sft.yaml"
# (config, model, mode, peft, nodes, overrides): each shipped config as its header plans it; Super has no shipped
# pretraining config, so its quickstart stands in with indexed data named (as the dry-run test above does).
SHIPPED_JOBS = [
    (QUICKSTART, "nano", "sft", None, 16, []),
    (QUICKSTART, "nano", "sft", "lora", 16, []),
    ("configs/smoke/nemotron_nano_smoke_sft.yaml", "nano", "sft", None, 4, []),
    ("configs/cluster_runs/nemotron_nano_pretrain.yaml", "nano", "pretrain", None, 16, PRETRAIN_DATA),
    ("configs/cluster_runs/nemotron_nano_cpt.yaml", "nano", "cpt", None, 16, PRETRAIN_DATA),
    (SUPER_QS, "super", "sft", None, 16, []),
    (SUPER_QS, "super", "sft", "lora", 16, []),
    (SUPER_QS, "super", "pretrain", None, 16, NOT_SFT),
    (SUPER_QS, "super", "cpt", None, 16, NOT_SFT),
]
GPUS_PER_NODE = 4  # isambard_gh200, every shipped config's cluster


def test_bridges_own_validation_passes_every_shipped_job(harness, tmp_path):
    """Every shipped model x mode x peft, each from its shipped config, through the dry run's plan (preflight passed)
    and build_config, then Bridge's own ``ConfigContainer.validate()`` (what setup() runs on every rank before
    anything else) at the job's world size. On a machine without Transformer Engine megatron-core refuses its fused
    kernels' switches (fused rope, fused permute): those, and only those, are turned off on the copy validated,
    and named. Before the data-source fix every SFT job died here: the recipes' SQuAD source beside our
    dataset_root ("Exactly one text-only SFT source must be set"); the Nano pretraining and CPT configs died on
    full recompute under the recipe's Transformer Engine CUDA graphs."""
    ops = []
    base = tmp_path / "base"  # Bridge's checkpoint section asserts the pretrained checkpoint exists: a folder here
    base.mkdir()
    for config, model, mode, peft, nodes, extra in SHIPPED_JOBS:
        cfg = our_config(model, mode, peft, config=config, overrides=extra, nodes=nodes)
        if cfg["checkpoint"].get("pretrained_checkpoint"):
            cfg = our_config(model, mode, peft, config=config, nodes=nodes,
                             overrides=[*extra, f"checkpoint.pretrained_checkpoint={base}"])
        ops.append({"op": "build_config", "id": f"{config}:{model}/{mode}/{peft}", "cfg": cfg, "model": model,
                    "mode": mode, "peft": peft, "validate_world": nodes * GPUS_PER_NODE,
                    "root": cfg["dataset"].get("dataset_root")})
    results = drive(harness, ops)
    assert len(results) == len(SHIPPED_JOBS)
    unvalidated: set[str] = set()
    for op, r in zip(ops, results):
        assert "error" not in r, f"{r['id']}: {r['error']} at {r['where']}\n{r.get('trace', '')}"
        v = r["validated"]
        assert v["ok"], f"{r['id']}: Bridge's validate() refused it: {v['error']} at {v['where']}\n{v['trace']}"
        assert set(v["te_kernels_off"]) <= {"model.apply_rope_fusion", "model.moe_permute_fusion"}, v
        # the one section left unvalidated here, and only where the recipe needs it (Super's; never Nano's)
        assert set(v["not_validated"]) <= {"optimizer.finalize (use_precision_aware_optimizer: Transformer Engine's "
                                           "FusedAdam)"} and not (op["model"] == "nano" and v["not_validated"]), v
        unvalidated.update(v["not_validated"])
        if op["mode"] == "sft":  # one data source, ours
            assert v["dataset"] == "GPTSFTDatasetConfig" and v["sources"]["dataset_root"] == op["root"], v
            assert v["sources"]["hf_dataset"] is None and v["sources"]["hf_validation_proportion"] is None, v
        else:  # Bridge's finalize() turned our data_path into the blend it reads
            assert v["dataset"] == "GPTDatasetConfig", v
            assert v["sources"]["blend"] == [["/data/corpus_text_document"], None], v
    print("validated whole except:", sorted(unvalidated) or "nothing")


def test_our_data_source_replaces_the_recipes_whole(harness):
    """pipeline.bridge.one_data_source on the real recipes' dataset configs: the SFT recipe's SQuAD source (hf_dataset,
    validation proportion 0.1) is cleared whole when we name dataset_root, and Bridge's own validate() then passes
    (it refused the pair: "Exactly one text-only SFT source"); the reverse (a base config's dataset_root, our HF
    source) too; two sources named by us is one line; naming none leaves the recipe's; the pretraining recipe's
    blend gives way to our data_path (finalize() reads blend first)."""
    (sft,) = drive(harness, [{"op": "data_source", "model": "nano", "mode": "sft", "cases": [
        {"named": ["dataset_root", "seq_length"], "set": {"dataset_root": "/data/packed"}},
        {"named": ["hf_dataset"], "set": {"dataset_root": "/base/config/root", "hf_dataset": {"dataset_name": "tulu3"}}},
        {"named": ["dataset_root", "hf_validation_proportion"], "set": {"dataset_root": "/data/packed"}},
        {"named": ["seq_length"]},
    ]}])
    assert "error" not in sft, sft
    groups = [tuple(g) for g in sft["groups"]]
    hf = next(g for g in groups if "hf_dataset" in g)
    assert ("dataset_root",) in groups and {"hf_validation_dataset", "hf_test_dataset", "hf_output_root",
                                            "hf_validation_proportion", "hf_rewrite"} <= set(hf), groups
    ours, reverse, two, none = sft["cases"]
    assert set(ours["cleared"]) == {"hf_dataset", "hf_validation_proportion"} and ours["invalid"] is None, ours
    assert ours["left"]["dataset_root"] == "/data/packed" and all(ours["left"][n] in (None, False) for n in hf)
    assert reverse["cleared"] == ["dataset_root"] and reverse["left"]["hf_dataset"]["dataset_name"] == "tulu3", reverse
    assert two == {"refused": "dataset.dataset_root and dataset.hf_validation_proportion are two data sources: "
                              "name one (the other is the recipe's to drop)"}
    # naming none: the recipe's own source, as the recipe wrote it (SQuAD), valid on its own
    assert none["cleared"] == [] and none["left"]["hf_dataset"]["dataset_name"] == "squad" and none["invalid"] is None

    (gpt,) = drive(harness, [{"op": "data_source", "model": "nano", "mode": "pretrain", "cases": [
        {"named": ["data_path"], "set": {"data_path": ["/data/corpus_text_document"],
                                         "blend": [["/recipe/blend_text_document"], None]}},
    ]}])
    assert "error" not in gpt, gpt
    assert [tuple(g) for g in gpt["groups"]] == [("data_path",), ("blend",), ("blend_per_split",)]
    (case,) = gpt["cases"]
    assert case["cleared"] == ["blend"] and case["invalid"] is None, case
    assert case["left"]["blend"] == [["/data/corpus_text_document"], None], case  # finalize() built it from ours


# ---- c: misspelled and wrong-type Bridge keys -----------------------------------------------------------------
def test_misspelled_and_wrong_type_keys(harness):
    """What Bridge's own process_config_with_overrides does with a misspelled key and with a wrong-type value
    (observed, Bridge 0.6.2), and what the project's login-node preflight does with the same input."""
    from pipeline.common.errors import UserError

    cases = [
        {"cli": ["+model.tensor_model_paralel_size=2"],
         "read_back": ["model.tensor_model_paralel_size", "model.tensor_model_parallel_size"]},
        {"cli": ["model.tensor_model_paralel_size=2"]},
        {"yaml": "model:\n  tensor_model_paralel_size: 2\n", "read_back": ["model.tensor_model_paralel_size"]},
        {"cli": ["model.tensor_model_parallel_size=two"], "read_back": ["model.tensor_model_parallel_size"]},
        {"yaml": "train:\n  train_iters: forty\n", "read_back": ["train.train_iters"]},
        {"cli": ["model.sequence_parallel=maybe"], "read_back": ["model.sequence_parallel"]},
    ]
    (r,) = drive(harness, [{"op": "overrides", "model": "nano", "mode": "sft", "cases": cases}])
    assert "error" not in r, r
    plus, bare, yaml_typo, cli_type, yaml_type, bool_type = r["cases"]
    # Bridge: a '+' misspelled key is accepted and silently DROPPED (no error; TP stays the recipe's 1).
    assert plus["raised"] is False
    assert plus["read_back"] == {"model.tensor_model_paralel_size": "<absent>", "model.tensor_model_parallel_size": 1}
    # Bridge: without '+', Hydra's override grammar refuses the unknown key.
    assert bare["raised"] and bare["error"].startswith("OverridesError") and "tensor_model_paralel_size" in bare["error"]
    # Bridge: the same typo in the YAML file is silently dropped too.
    assert yaml_typo["raised"] is False and yaml_typo["read_back"] == {"model.tensor_model_paralel_size": "<absent>"}
    # Bridge: a wrong-type value is stored as given (no type check): a string in an int field.
    assert cli_type["raised"] is False and cli_type["read_back"] == {"model.tensor_model_parallel_size": "two"}
    assert yaml_type["raised"] is False and yaml_type["read_back"] == {"train.train_iters": "forty"}
    assert bool_type["raised"] is False and bool_type["read_back"] == {"model.sequence_parallel": "maybe"}

    # The project: the login-node preflight must reject what Bridge swallows.
    from pipeline.cli.train import plan_from_argv

    base = [QUICKSTART, "--model", "nano", "--mode", "sft", "--dry-run", "--no-path-checks", "--nodes", "16"]
    with pytest.raises(UserError, match="tensor_model_paralel_size"):
        plan_from_argv([*base, "model.tensor_model_paralel_size=2"])
    for bad in ("model.tensor_model_parallel_size=two", "train.train_iters=forty"):
        plan = plan_from_argv([*base, bad]).preflight
        assert not plan.ok and any("must be an integer" in p for p in plan.problems), (bad, plan.problems)
    # What Bridge swallows, the login-node preflight refuses (checked against config/bridge_fields.json, which
    # test_recorded_field_table_is_current proves equal to the real ConfigContainer).
    plan = plan_from_argv([*base, "+model.tensor_model_paralel_size=2"]).preflight
    assert not plan.ok and any("'model.tensor_model_paralel_size' is not a field of Megatron Bridge's nano sft"
                               in p and "did you mean 'model.tensor_model_parallel_size'" in p for p in plan.problems)
    plan = plan_from_argv([*base, "model.sequence_parallel=maybe"]).preflight
    assert not plan.ok and any("model.sequence_parallel='maybe' must be a boolean" in p for p in plan.problems)
    plan = plan_from_argv([QUICKSTART, "--model", "nano", "--mode", "pretrain", "--dry-run",
                           "--no-path-checks", "--nodes", "16"]).preflight
    assert not plan.ok and {p.split("'")[1] for p in plan.problems if "is not a field" in p} == {
        "dataset.dataset_root", "dataset.offline_packing_specs"}


def test_recorded_field_table_is_current(harness):
    """config/bridge_fields.json (what the login-node preflight checks keys and types against) equals the
    sections, classes and field kinds of the pinned Bridge's real recipe ConfigContainers."""
    (r,) = drive(harness, [{"op": "fields"}])
    assert "error" not in r, f"{r['error']} at {r['where']}\n{r.get('trace', '')}"
    recorded = json.loads((ROOT / "src" / "pipeline" / "config" / "bridge_fields.json").read_text())
    assert r["table"]["recipes"] == recorded["recipes"]
    assert r["table"]["classes"] == recorded["classes"], "regenerate src/pipeline/config/bridge_fields.json"
    assert set(recorded["recipes"]) == {f"{m}/{k}" for m in ("nano", "super") for k in ("pretrain", "sft", "peft")}


# ---- d: checkpoint paths: Bridge's real resolution ------------------------------------------------------------
def _fake_megatron_checkpoint(root: Path) -> None:
    for it in (200, 400):  # complete torch_dist iterations
        d = root / f"iter_{it:07d}"
        d.mkdir(parents=True)
        (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        (d / "common.pt").write_bytes(b"\0")
        (d / "__0_0.distcp").write_bytes(b"\0")
    half = root / "iter_0000600"  # still being written: no common.pt, no shard yet
    half.mkdir()
    (half / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (root / "latest_checkpointed_iteration.txt").write_text("400\n")


def test_checkpoint_paths_bridge_resolution(harness, tmp_path):
    """AutoBridge.load_megatron_model's real path resolution (only the loader it hands the path to,
    megatron.bridge.training.model_load_save.load_megatron_model, is a recorder): the ROOT picks the
    half-written iter_0000600; what our code passes (layout.resolve_iteration) is handed on unchanged."""
    from pipeline.common.layout import is_complete_dir, resolve_iteration

    root = tmp_path / "ckpt"
    _fake_megatron_checkpoint(root)
    assert is_complete_dir(root / "iter_0000200") and is_complete_dir(root / "iter_0000400")
    assert not is_complete_dir(root / "iter_0000600")
    ours = {"root": root, "at_200": resolve_iteration(root, 200), "latest": resolve_iteration(root, None)}
    (r,) = drive(harness, [{"op": "load_paths", "hf_model": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
                            "paths": {k: str(v) for k, v in ours.items()}}])
    assert "error" not in r, r
    handed = {k: Path(v) for k, v in r["handed"].items()}
    assert handed["root"] == root / "iter_0000600"  # the defect our layout exists to avoid
    assert handed["at_200"] == root / "iter_0000200"
    assert handed["latest"] == root / "iter_0000400"
    assert all(p.name != "iter_0000600" for k, p in handed.items() if k != "root")


# ---- e: HF -> Megatron -> HF on CPU ---------------------------------------------------------------------------
def test_hf_megatron_roundtrip_cpu(harness, tmp_path):
    """A tiny Llama (random weights saved with transformers): Bridge's HF -> Megatron load on CPU (gloo world
    of one, local layer spec) and Megatron -> HF export_hf_weights give back every tensor bit-equal. Where CPU
    stops (recorded and asserted, so a Bridge change shows up): AutoBridge.import_ckpt as shipped (the Llama
    bridge enables apply_rope_fusion, TE only), the Megatron forward (RoPE moves inv_freq to CUDA) and
    save_megatron_model (torch.cuda.get_rng_state), hence no file-based export_ckpt."""
    llama = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (r,) = drive(harness, [{"op": "roundtrip", "workdir": str(tmp_path), "llama": llama, "port": port}])
    assert "error" not in r or "steps" in r, r
    steps = {s["step"]: s for s in r["steps"]}
    assert steps["provide_distributed_model(cpu)"]["ok"], steps["provide_distributed_model(cpu)"]
    assert steps["export_hf_weights(cpu)"]["ok"], steps["export_hf_weights(cpu)"]
    assert r["inmemory_tensors"] == 2 * 9 + 3  # per layer 9 (q,k,v,o,gate,up,down,2 norms) + embed, norm, lm_head
    assert r["inmemory_missing"] == [] and r["inmemory_unexpected"] == [] and r["inmemory_unequal"] == []
    # The CPU stops, as observed with Bridge 0.6.2 / megatron-core 0.19.2.
    shipped = steps["AutoBridge.import_ckpt (as shipped)"]
    assert not shipped["ok"] and "apply_rope_fusion" in shipped["error"], shipped
    fwd = steps.get("megatron forward")
    assert fwd is not None and not fwd["ok"] and "rotary_pos_embedding.py" in fwd["where"], fwd
    save = steps["save_megatron_model"]
    assert not save["ok"] and "checkpointing.py" in save["where"] and "CUDA" in save["error"], save


# ---- f: loss masks of short replies, read back by Bridge's own packed reader (issue 22) -------------------------
def test_short_replies_are_trained_on_themselves_in_bridges_reader(harness, tmp_path, tokenizer):
    """Multiple-choice data (one-letter replies, replies equal to template words): every sequence Bridge's packed-SFT
    reader collates from our Parquet trains on the reply and its <|im_end|>, never on template tokens."""
    from pipeline.data.prepare import PrepareOptions, prepare

    replies = [*"abcdeimstn", "assistant", "im_end", "user", "system", "a", "b"] * 3
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: pick one"},
                                                     {"role": "assistant", "content": r}]}) + "\n"
                            for i, r in enumerate(replies)))
    summary = prepare(PrepareOptions(dataset=str(data), dataset_root=tmp_path / "root", seq_length=256,
                                     val_fraction=0.0, quiet=True, workers=1))
    [r] = drive(harness, [{"op": "packed_read", "path": summary["pack"]["paths"]["train"], "seq_length": 256,
                           "eos_id": tokenizer.eos_token_id, "bos_id": tokenizer.bos_token_id}])
    assert "error" not in r, f"{r['error']} at {r['where']}"
    # Bridge's collate pads each pack and gives the padding its own cu_seqlens segment (no loss there)
    got = sorted(tokenizer.decode(ids) for ids in r["sequences"] if ids)
    assert got == sorted(f"{x}<|im_end|>" for x in replies), got


# ---- g: ft_launcher's fault-tolerance settings reach Bridge's ConfigContainer (issue 32, item 2) ---------------
FT_LAUNCHER_ENV = {"TORCHELASTIC_RUN_ID": "4242", "PIPELINE_LAUNCHER": "ft_launcher"}


def test_ft_launcher_settings_reach_a_real_fault_tolerance_config(harness, tmp_path):
    """Under ft_launcher the engine adds ft.enable_ft_package / ft.calc_ft_timeouts (launch_overrides, with
    ft_launcher's environment), and a user YAML may carry an ``ft:`` section; Bridge's recipes leave
    ``ConfigContainer.ft`` None. build_config on the real recipe and override code must give the container a real
    FaultToleranceConfig holding those values (before the fix: OverridesError "Could not override
    'ft.enable_ft_package'", and a YAML ``ft:`` section landed as a plain dict)."""
    import yaml

    from pipeline.training.engines.megatron_bridge import launch_overrides

    extra = launch_overrides(FT_LAUNCHER_ENV)
    assert launch_overrides({"TORCHELASTIC_RUN_ID": "1"}) == [] and launch_overrides({}) == []
    user_yaml = tmp_path / "with_ft.yaml"
    doc = yaml.safe_load((ROOT / QUICKSTART).read_text())
    doc["ft"] = {"calc_ft_timeouts": True}
    user_yaml.write_text(yaml.safe_dump(doc))
    read_back = ["ft.enable_ft_package", "ft.calc_ft_timeouts", "ft.simulate_fault"]
    ops = [{"op": "build_config", "id": "ft_launcher", "cfg": our_config("nano", "sft", None), "model": "nano",
            "mode": "sft", "extra_overrides": extra, "read_back": read_back},
           {"op": "build_config", "id": "yaml_ft", "cfg": our_config("nano", "sft", None, config=str(user_yaml)),
            "model": "nano", "mode": "sft", "read_back": read_back},
           {"op": "build_config", "id": "plain", "cfg": our_config("nano", "sft", None), "model": "nano",
            "mode": "sft"}]
    launcher, from_yaml, plain = drive(harness, ops)
    for r in (from_yaml, launcher):
        assert "error" not in r, f"{r['id']}: {r['error']} at {r['where']}\n{r.get('trace', '')}"
        assert r["container_types"]["ft"] == "FaultToleranceConfig", r["container_types"]
        assert not r["mismatches"], r["mismatches"]
    assert launcher["extra"] == {"ft.enable_ft_package": True, "ft.calc_ft_timeouts": True, "ft.simulate_fault": False}
    assert from_yaml["extra"] == {"ft.enable_ft_package": False, "ft.calc_ft_timeouts": True,
                                  "ft.simulate_fault": False}
    assert "ft.calc_ft_timeouts" in from_yaml["checked"]
    # without ft_launcher or an ft: section the recipe's None is kept (Bridge's setup then skips NVRx)
    assert "error" not in plain and plain["container_types"]["ft"] == "NoneType"


def test_a_continuing_phase_reaches_bridges_load_fields(harness, tmp_path):
    """A phase continuing another's save (issue 33, init: continue): our resolved config names Bridge's own fields
    (checkpoint.load = the previous phase's save, ckpt_step = its iteration, override_opt_param_scheduler set by the
    launcher, load_optim / load_rng left at Bridge's True, finetune False), and the engine's per-attempt overrides
    (load_overrides) reach the real ConfigContainer: the first attempt pins ckpt_step, a requeue once the phase's
    own save holds a checkpoint resumes that save (load = save, ckpt_step None), never the previous phase's."""
    from pipeline.config.schema import TrainingConfig
    from pipeline.training.engines.megatron_bridge import load_overrides
    from pipeline.training.records import StartPoint

    prev, own = tmp_path / "pretrain" / "checkpoints", tmp_path / "cooldown" / "checkpoints"
    cfg = our_config("nano", "sft", None, overrides=[f"checkpoint.load={prev}", "checkpoint.ckpt_step=40",
                                                     f"checkpoint.save={own}", "train.train_iters=80"])
    assert cfg["scheduler"]["override_opt_param_scheduler"] is True  # finalize_config: the phase's own schedule
    typed = TrainingConfig.from_dict(cfg)
    first = load_overrides(typed, StartPoint("continue", 40, 40, prev / "iter_0000040"))
    again = load_overrides(typed, StartPoint("resume", 60, 40, own / "iter_0000060"))
    assert first == ["checkpoint.ckpt_step=40"] and again == [f"checkpoint.load={own}", "checkpoint.ckpt_step=null"]
    read_back = ["checkpoint.load", "checkpoint.ckpt_step", "checkpoint.save", "checkpoint.load_optim",
                 "checkpoint.load_rng", "checkpoint.finetune", "scheduler.override_opt_param_scheduler",
                 "scheduler.use_checkpoint_opt_param_scheduler", "train.train_iters"]
    ops = [{"op": "build_config", "id": i, "cfg": cfg, "model": "nano", "mode": "sft", "extra_overrides": extra,
            "read_back": read_back} for i, extra in (("first", first), ("requeue", again))]
    a, b = drive(harness, ops)
    for r in (a, b):
        assert "error" not in r, f"{r['id']}: {r['error']} at {r['where']}\n{r.get('trace', '')}"
    common = {"checkpoint.save": str(own), "checkpoint.load_optim": True, "checkpoint.load_rng": True,
              "checkpoint.finetune": False, "scheduler.override_opt_param_scheduler": True,
              "scheduler.use_checkpoint_opt_param_scheduler": False, "train.train_iters": 80}
    assert a["extra"] == {**common, "checkpoint.load": str(prev), "checkpoint.ckpt_step": 40}
    assert b["extra"] == {**common, "checkpoint.load": str(own), "checkpoint.ckpt_step": None}


# ---- h: the suite's callback on Bridge's real callback machinery (issue 32, items 4 and 6) ---------------------
def test_bridge_callback_records_iterations_one_to_n_and_the_saved_iteration(harness, tmp_path):
    """The engine's hooks behind pipeline.bridge.make_callback, fired through Bridge's real CallbackManager with real
    CallbackContext / GlobalState / TrainState in train.py's order (driver op step_records; its docstring quotes
    train.py). Stand-ins for CUDA-only calls, named in the op: the train step, the optimizer, the checkpoint writer
    (it writes the tracker with the suite's layout helper) and the async worker's completion.

    Records and events count iterations 1..N as the local engine, Megatron's log and iter_* do (before the fix:
    0..N-1, on_train_step_end fires before Bridge's step += 1). With checkpoint.async_save (the Super recipes) the
    save callback runs at finalisation, steps later: the save event names the iteration saved (before: the current
    step, 4 for the save of 2)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (r,) = drive(harness, [{"op": "step_records", "run_dir": str(run_dir), "iters": 5, "save_interval": 2,
                            "async_save": True}])
    assert "error" not in r, f"{r['error']} at {r['where']}\n{r.get('trace', '')}"
    assert r["progress_steps"] == [1, 2, 3, 4, 5]
    assert r["events"] == [["step", 1], ["step", 2], ["step", 3], ["step", 4], ["save", 2], ["step", 5],
                           ["save", 4], ["save", 5]]
    assert r["tracker"] == 5 and not r["should_exit"]


def test_an_early_save_request_waits_for_bridges_signal_handler(harness, tmp_path):
    """A time-limit request already there when the rank starts: the watcher must not signal before pretrain()
    has installed Bridge's DistributedSignalHandler (before the fix its SIGTERM, under the default handler, killed
    the rank: here the driver process). Armed at the first step, it signals; Bridge's real handler catches it and
    checkpoint_and_decide_exit's real signals_received() stops the loop after iteration 1, saved as 1."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (r,) = drive(harness, [{"op": "step_records", "run_dir": str(run_dir), "iters": 10, "save_interval": None,
                            "request_early": True}])
    assert "error" not in r, f"{r['error']} at {r['where']}\n{r.get('trace', '')}"
    assert r["fired_before_handler"] is False
    assert r["should_exit"] is True and r["tracker"] == 1
    assert r["progress_steps"] == [1] and r["events"] == [["step", 1], ["save", 1]]


# ---- i: megatron-core's NaN error is the one the engine turns into FAILED_NAN (issue 32, item 7) ---------------
def test_megatrons_real_nan_error_is_recognised(harness):
    """Bridge's real loss function and megatron-core's real rerun state machine on a NaN and an Inf loss (driver op
    nan_message; stand-in for the CUDA-only torch.cuda.current_device): the RuntimeError they raise is what
    pipeline.bridge.is_nonfinite_failure recognises, so the engine writes FAILED_NAN on it (tests/unit/
    test_bridge_engine_end.py runs the engine's side with this message)."""
    from tests.unit.test_bridge_engine_end import NAN_ERROR

    (r,) = drive(harness, [{"op": "nan_message"}])
    assert "error" not in r, f"{r['error']} at {r['where']}\n{r.get('trace', '')}"
    for name in ("nan", "inf"):
        assert r[name]["raised"] and r[name]["type"] == "RuntimeError", r[name]
        assert r[name]["recognised"] is True, r[name]["message"]
    assert "found NaN in local forward loss calculation" in r["nan"]["message"]
    assert r["finite"] == {"raised": False}
    # the unit test's copy has the real message's shape
    shape = r["nan"]["message"].split(": Unexpected result ")[1]
    assert NAN_ERROR.endswith(shape), (NAN_ERROR, r["nan"]["message"])


# ---- j: profiling: the typed fields in Bridge's ProfilingConfig, and the steps its torch profiler records (issue 35) -
PROFILING = ["profiling.use_pytorch_profiler=true", "profiling.profile_step_start=2", "profiling.profile_step_end=4",
             "profiling.profile_ranks=[0,3]", "profiling.record_memory_history=true",
             "profiling.memory_snapshot_path=/scratch/run/snapshot.pickle",
             "profiling.pytorch_profiler_collect_shapes=true"]


def test_profiling_fields_reach_bridges_profiling_config_and_its_window(harness, tmp_path):
    """The suite's typed profiling fields, through the dry run's plan (preflight passed) and build_config on the real
    recipe and override code, land in Bridge 0.6.2's own ProfilingConfig, which Bridge's validation (finalize)
    accepts; a window the preflight refuses, Bridge's finalize refuses too. The engine's tensorboard_overrides point
    logger.tensorboard_dir at <run_dir>/tb, and Bridge's real profiler functions, run in train.py's order, then
    write their trace to <run_dir>/torch_profile/rank-0.json.gz (where the local engine writes its own), holding
    exactly the steps pipeline.training.profiling.window says: the local engine's rule is Bridge's."""
    import socket

    from pipeline.cli.train import plan_from_argv
    from pipeline.config.schema import TrainingConfig
    from pipeline.training import profiling
    from pipeline.training.engines.megatron_bridge import tensorboard_overrides

    cfg = our_config("nano", "sft", None, overrides=PROFILING)
    run_dir = tmp_path / "run"
    extra = tensorboard_overrides(TrainingConfig.from_dict(cfg), run_dir)
    assert extra == [f"logger.tensorboard_dir={run_dir / 'tb'}"]
    bad = {**cfg, "profiling": {**cfg["profiling"], "profile_step_start": 5, "profile_step_end": 3}}
    base = [QUICKSTART, "--model", "nano", "--mode", "sft", "--dry-run", "--no-path-checks", "--nodes", "16"]
    plan = plan_from_argv([*base, "profiling.profile_step_start=5", "profiling.profile_step_end=3"]).preflight
    assert not plan.ok and any("profiling.profile_step_end(3) must be >= profiling.profile_step_start(5)" in p
                               for p in plan.problems), plan.problems
    fields = ["use_pytorch_profiler", "profile_step_start", "profile_step_end", "profile_ranks",
              "record_memory_history", "memory_snapshot_path", "pytorch_profiler_collect_shapes", "use_nsys_profiler"]
    read_back = [f"profiling.{f}" for f in fields] + ["logger.tensorboard_dir"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    windows = [{"start": a, "end": b, "tensorboard_dir": str(tmp_path / f"w{a}_{b}" / "tb")}
               for a, b in ((0, 3), (1, 3), (5, 8))]
    windows.insert(0, {"start": 2, "end": 4, "tensorboard_dir": str(run_dir / "tb")})
    good, refused, win = drive(harness, [
        {"op": "build_config", "id": "profiling", "cfg": cfg, "model": "nano", "mode": "sft", "extra_overrides": extra,
         "read_back": read_back, "finalize": ["profiling"], "trace_ranks": [0, 1]},
        {"op": "build_config", "id": "refused", "cfg": bad, "model": "nano", "mode": "sft", "finalize": ["profiling"]},
        {"op": "profiling_window", "windows": windows, "iters": 8, "port": port}])
    assert "error" not in good, f"{good['error']} at {good['where']}\n{good.get('trace', '')}"
    assert good["container_types"]["profiling"] == "ProfilingConfig"
    assert not good["mismatches"], good["mismatches"]
    assert {k for k in good["checked"] if k.startswith("profiling.")} == {
        f"profiling.{f}" for f in fields if f != "use_nsys_profiler"}
    assert good["extra"] == {
        "profiling.use_pytorch_profiler": True, "profiling.profile_step_start": 2, "profiling.profile_step_end": 4,
        "profiling.profile_ranks": [0, 3], "profiling.record_memory_history": True,
        "profiling.memory_snapshot_path": "/scratch/run/snapshot.pickle",
        "profiling.pytorch_profiler_collect_shapes": True, "profiling.use_nsys_profiler": False,
        "logger.tensorboard_dir": str(run_dir / "tb")}
    assert good["finalized"] == {"profiling": {"ok": True}}
    assert "error" not in refused and refused["finalized"]["profiling"]["ok"] is False
    assert "profile_step_end (3) must be >= profile_step_start (5)" in refused["finalized"]["profiling"]["error"]

    assert "error" not in win, f"{win['error']} at {win['where']}\n{win.get('trace', '')}"
    for w in win["windows"]:
        first, last = profiling.window(w["start"], w["end"])
        assert w["written"] and w["recorded"] == list(range(first, last + 1)), w
    assert win["windows"][0]["recorded"] == [2, 3]
    # the trace is where the local engine writes its own, and where the Bridge engine looks for it
    assert win["windows"][0]["trace"] == str(profiling.trace_path(run_dir, 0))
    assert good["bridge_trace"] == {"0": str(profiling.trace_path(run_dir, 0)), "1": None}


# ---- k: the planner's shape rules are megatron-core's (issue 34) -------------------------------------------------
def test_the_planners_shape_rules_are_megatron_cores(harness):
    """config/parallel.py states megatron-core's rules for the model's shape without megatron-core (the login node
    has none); here megatron-core 0.19.2's own select_pipeline_segment splits the real Nano and Super patterns (and
    others) over many pipeline sizes, even and uneven, and its TransformerConfig takes or refuses heads / KV heads /
    tp: the planner refuses exactly what they refuse (driver op shape_rules)."""
    from dataclasses import replace

    from pipeline.config.models import get_model
    from pipeline.config.parallel import pp_shape_problem, tp_shape_problem

    nano, sup = get_model("nano").shape, get_model("super").shape
    patterns = [nano.hybrid_pattern, sup.hybrid_pattern, "M*M*", "MEM*E", "M" * 12]
    splits = [{"pattern": p, "pp": pp} for p in patterns for pp in range(1, 13) if pp <= len(p)]
    splits += [{"pattern": sup.hybrid_pattern, "pp": 8, "last": 4}, {"pattern": sup.hybrid_pattern, "pp": 6, "last": 8},
               {"pattern": sup.hybrid_pattern, "pp": 6, "last": 4}, {"pattern": nano.hybrid_pattern, "pp": 3,
                                                                    "first": 16, "last": 18},
               {"pattern": nano.hybrid_pattern, "pp": 4, "first": 10}, {"pattern": "M*M*", "pp": 2, "first": 3}]
    heads = [{"heads": h, "kv": kv, "tp": tp} for h, kv in ((32, 2), (9, 3), (4, 2), (32, 8))
             for tp in (1, 2, 3, 4, 6, 8, 16)]
    (r,) = drive(harness, [{"op": "shape_rules", "splits": splits, "heads": heads}])
    assert "error" not in r, f"{r['error']} at {r['where']}\n{r.get('trace', '')}"
    refused = 0
    for case in r["splits"]:
        shape = replace(nano, num_layers=len(case["pattern"]), hybrid_pattern=case["pattern"])
        ours = pp_shape_problem(shape, case["pp"], case.get("first"), case.get("last"))
        assert (ours is None) == (case["error"] is None), (case, ours)
        if case["ranks"]:  # megatron-core's split covers the pattern once, in order
            assert [o for o, _ in case["ranks"]] == [sum(n for _, n in case["ranks"][:i])
                                                     for i in range(len(case["ranks"]))]
            assert sum(n for _, n in case["ranks"]) == len(case["pattern"])
        refused += case["error"] is not None
    by = {(c["pattern"], c["pp"], c.get("first"), c.get("last")): c for c in r["splits"]}
    assert "evenly divisible" in by[(sup.hybrid_pattern, 6, None, None)]["error"]  # the reference's Super --pp 6
    assert by[(sup.hybrid_pattern, 8, None, 4)]["ranks"][-1] == [84, 4]  # Bridge's 32K SFT recipe
    assert refused and refused < len(r["splits"])
    for case in r["heads"]:
        shape = replace(nano, num_attention_heads=case["heads"], num_query_groups=case["kv"], hybrid_pattern="")
        assert (tp_shape_problem(shape, case["tp"]) is None) == (case["error"] is None), case


def test_core_imports_are_megatron_cores_own(harness):
    """pipeline.bridge.CORE_IMPORTS (what validate's gpu-packages imports of mamba-ssm and causal-conv1d) is exactly
    what the pinned megatron-core's mamba_mixer imports of them in its guarded try blocks (read from its source in
    the harness venv): a name megatron-core adds or renames there shows here."""
    import ast

    from pipeline.bridge import CORE_IMPORTS

    src = (VENV / "megatron-site" / "megatron" / "core" / "ssm" / "mamba_mixer.py").read_text()
    guarded = {(node.module, alias.name) for t in ast.parse(src).body if isinstance(t, ast.Try)
               for node in t.body if isinstance(node, ast.ImportFrom) and node.module
               and node.module.split(".")[0] in CORE_IMPORTS for alias in node.names}
    assert guarded == {pair for pairs in CORE_IMPORTS.values() for pair in pairs}, guarded


def test_the_login_nodes_gpu_package_table_is_the_recipes(harness):
    """ModelSpec.gpu_packages (what the login-node preflight checks the image's record against) equals what Bridge's
    real recipes select (pipeline.bridge.recipe_gpu_packages, read from the ConfigContainer each builds: TE, the
    Mamba packages for a pattern with Mamba layers, DeepEP for the flex dispatcher)."""
    from pipeline.config.models import get_model

    dist = {"transformer_engine": "transformer-engine", "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d",
            "deep_ep": "deep-ep"}
    recipes = [(m, mode) for m in ("nano", "super") for mode in ("pretrain", "sft")]
    (r,) = drive(harness, [{"op": "gpu_packages", "recipes": recipes}])
    assert "error" not in r, r
    for model, mode in recipes:
        want = sorted(dist[m] for m in r["packages"][f"{model} {mode}"])
        assert sorted(get_model(model).gpu_packages[mode]) == want, (model, mode, want)
    assert "deep-ep" in get_model("nano").gpu_packages["sft"] and "deep-ep" not in get_model("super").gpu_packages["sft"]
