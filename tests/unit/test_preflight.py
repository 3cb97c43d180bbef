"""Login-node preflight: the reference quickstart plans on a CPU machine; broken variants exit 2 with one
line per problem naming the factors."""

import re

import pytest

from pipeline.cli.train import main

NANO = "configs/quickstart/nemotron_nano_quickstart_sft.yaml"
# as the config's header documents it: --disable-ft, since its checkpoint.save is null (issue 47)
BASE = [NANO, "--model", "nano", "--mode", "sft", "--disable-ft", "--dry-run", "--nodes", "16", "--no-path-checks"]
SAVE = "checkpoint.save=/projects/a5k/public/checkpoints/megatron/nano_ft"


def errors(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def test_nano_quickstart_plans_without_gpus(capsys):
    assert main(BASE) == 0
    out = capsys.readouterr().out
    assert "preflight: PASS" in out
    assert "tp 1 pp 1 cp 2 ep 4 etp 1 -> dp 32" in out
    assert "gbs 128 = mbs 1 x dp 32 x grad_accum 4" in out
    assert "memory estimate" in out and "of 95 GB" in out
    assert "isambard_sbatch --nodes=16 pipeline_training_submit.sbatch" in out


def test_ft_launcher_unless_disabled(capsys):
    ft = [a for a in BASE if a != "--disable-ft"]
    assert main(ft + [SAVE]) == 0
    assert "ft_launcher" in capsys.readouterr().out
    assert main(BASE) == 0
    out = capsys.readouterr().out
    launch = out.splitlines()[out.splitlines().index("== launch command (per node) ==") + 1]
    # the environment the launch sets (the profile's NCCL over libfabric) comes first, as NAME=value words
    assert launch.startswith("NCCL_NET='AWS Libfabric' FI_PROVIDER=cxi ") and " torchrun --" in launch
    assert "ft_launcher --" not in out


def test_ft_launcher_without_a_save_directory_is_one_line(capsys):
    """Issue 47 item 1: under ft_launcher (the Isambard profile's launcher unless --disable-ft) Megatron Bridge's
    fault-tolerance setup raises on every rank when checkpoint.save is unset, and every restart burns: the quickstart
    config (save: null) is refused at planning with the fix; with a save directory, or --disable-ft, it plans."""
    ft = [a for a in BASE if a != "--disable-ft"]
    assert main(ft) == 2
    assert errors(capsys) == [
        "error: checkpoint.save is null, and fault tolerance (ft_launcher, the launcher of cluster profile "
        "'isambard_gh200') needs it: Megatron Bridge's fault-tolerance setup raises on every rank without a save "
        "directory; set checkpoint.save=DIR, or pass --disable-ft (plain torchrun)"]
    assert main(ft + [SAVE]) == 0
    out = capsys.readouterr().out
    assert "preflight: PASS" in out and " ft_launcher --" in out
    assert main(ft + ["--disable-ft"]) == 0
    assert "preflight: PASS" in capsys.readouterr().out
    assert main(BASE + ["ft.enable_ft_package=true"]) == 2  # fault tolerance asked for by the config itself
    assert errors(capsys)[0].endswith("set checkpoint.save=DIR, or set ft.enable_ft_package=false")


def test_path_checks_name_the_missing_dataset(capsys, tmp_path):
    """Its own missing root (issue 59, item 8): on the cluster's login node the reference's dataset exists."""
    missing = tmp_path / "data" / "geodesic-research__pa-warm-start-1B-sft-mix"
    assert main([*BASE[:-1], f"dataset.dataset_root={missing}"]) == 2
    errs = errors(capsys)
    assert any(f"dataset.dataset_root {missing} does not exist" in e for e in errs), errs


def test_a_lora_plan_says_lora_where_it_names_the_mode(capsys):
    """Issue 59's docs drift: a LoRA dry run said "lora" only inside its sbatch line; the plan's first line says the
    run trains adapters on a frozen base (as its memory estimate, with no gradients or Adam state for the base, has
    it), and a full fine-tune says nothing of adapters."""
    assert main([*BASE, "--peft", "lora"]) == 0
    out = capsys.readouterr().out
    assert "mode sft with lora adapters (--peft lora: the base weights frozen, only the adapters train)" in out, out
    assert main(BASE) == 0
    assert "adapters" not in capsys.readouterr().out


@pytest.mark.parametrize("overrides,needle", [
    (["model.expert_model_parallel_size=8"], "ep(8) * etp(1) = 8 > gpus_per_node(4)"),
    # etp = tp: the reference's TP x EP <= 4 (with etp = 1, tp 4 x ep 2 folds into one node and is accepted)
    (["model.tensor_model_parallel_size=4", "model.expert_model_parallel_size=2",
      "model.expert_tensor_parallel_size=4"], "ep(2) * etp(4) = 8 > gpus_per_node(4)"),
    (["model.context_parallel_size=3"], "is not divisible by tp(1) * pp(1) * cp(3) = 3"),
    (["train.global_batch_size=100"], "train.global_batch_size(100) is not divisible by micro_batch_size(1) * data_parallel(32) = 32"),
    (["dataset.offline_packing_specs.pad_seq_to_mult=2"], "pad_seq_to_mult(2) is not a multiple of 2*cp = 4"),
    (["model.context_parallel_size=4", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
      "model.expert_model_parallel_size=2", "dataset.offline_packing_specs.pad_seq_to_mult=4"],
     "lcm(2*cp, tp*cp) = lcm(8, 8) = 8"),
    (["dataset.seq_length=8192"], "dataset.seq_length(8192) != model.seq_length(32768)"),
    (["dataset.enable_offline_packing=false"], "the packed documents would reach the model without their boundaries"),
    (["model.recompute_granularity=null"], "estimated memory"),
])
def test_broken_variants_exit_2(capsys, overrides, needle):
    assert main(BASE + overrides) == 2
    errs = errors(capsys)
    assert any(needle in e for e in errs), errs


def test_world_size_not_dividing(capsys):
    assert main([*BASE[:-3], "--nodes", "3", "--no-path-checks", "model.context_parallel_size=2",
                 "model.tensor_model_parallel_size=4", "model.expert_model_parallel_size=1"]) == 2
    errs = errors(capsys)
    assert any("tp(4) * cp(2) = 8 > gpus_per_node(4)" in e for e in errs)


def test_unknown_key_and_malformed_override(capsys):
    assert main(BASE + ["train.train_iterz=5"]) == 2
    assert "did you mean 'train.train_iters'" in capsys.readouterr().err
    assert main(BASE + ["model.seq_length=[1"]) == 2
    assert "malformed override" in capsys.readouterr().err


def test_one_line_per_problem(capsys):
    assert main(BASE + ["model.expert_model_parallel_size=8", "train.global_batch_size=100"]) == 2
    errs = errors(capsys)
    assert len(errs) == 2, errs


def test_bad_flags_and_models(capsys):
    assert main([NANO, "--model", "nanoo", "--mode", "sft", "--dry-run"]) == 2
    assert "did you mean 'nano'" in capsys.readouterr().err
    assert main([NANO, "--model", "nano", "--mode", "finetune", "--dry-run"]) == 2
    assert main([NANO, "--model", "nano", "--mode", "sft", "--dry-run", "--cluster", "nope"]) == 2
    assert "unknown cluster profile 'nope'" in capsys.readouterr().err
    assert main(["configs/none.yaml", "--model", "nano", "--mode", "sft", "--dry-run"]) == 2


def test_cluster_override_changes_node_rule(capsys, tmp_path):
    prof = tmp_path / "eight.yaml"
    prof.write_text("name: eight\ngpus_per_node: 8\ngpu_memory_gb: 141\n")
    assert main(BASE + ["--cluster", str(prof), "model.expert_model_parallel_size=8", "--nodes", "8"]) == 0
    assert "nodes 8 x 8 ranks = world 64" in capsys.readouterr().out


def test_local_engine_rejects_model_parallelism(capsys):
    assert main(["configs/local/smollm2_quickstart_sft.yaml", "--model", "smollm2-135m", "--mode", "sft",
                 "--dry-run", "--no-path-checks", "model.tensor_model_parallel_size=2"]) == 2
    assert "the local engine has no model parallelism" in capsys.readouterr().err


@pytest.mark.parametrize("overrides,needle", [
    (["optimizer.lr=-1"], "optimizer.lr=-1 must be > 0"),
    (["optimizer.lr=nan"], "optimizer.lr=nan must be a finite number"),
    (["optimizer.lr=inf"], "optimizer.lr=inf must be a finite number"),
    (["scheduler.lr_warmup_iters=-5"], "scheduler.lr_warmup_iters=-5 must be >= 0"),
    (["+checkpoint.save_interval=0"], "checkpoint.save_interval=0 must be >= 1"),
    (["logger.log_interval=0"], "logger.log_interval=0 must be >= 1"),
])
def test_values_that_would_fail_after_the_allocation_starts(capsys, overrides, needle):
    ov = [o.lstrip("+") for o in overrides]
    assert main(BASE + ov) == 2
    errs = errors(capsys)
    assert any(needle in e for e in errs), errs


def test_bad_counts_and_unwritable_paths(capsys, tmp_path):
    assert main(BASE[:-3] + ["--nodes", "0", "--no-path-checks"]) == 2
    assert "--nodes 0 must be >= 1" in capsys.readouterr().err
    assert main(BASE + ["--max-restarts", "-1"]) == 2
    assert "--max-restarts -1 must be >= 0" in capsys.readouterr().err
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(BASE + ["--run-dir", str(f)]) == 2
    assert f"run directory {f} exists and is not a directory" in capsys.readouterr().err
    assert main(["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--dry-run",
                 f"checkpoint.save={f}/sub"]) == 2
    assert any(f"checkpoint.save {f}/sub cannot be created: {f} is a file" in e for e in errors(capsys))


def test_known_hazards_warn_and_lora_needs_less_memory(capsys):
    assert main(BASE + ["optimizer.lr=8e-5", "model.fp8=hybrid"]) == 0
    out = capsys.readouterr().out
    assert "warning: optimizer.lr=8e-05 with context_parallel_size=2" in out
    assert "warning: model.fp8='hybrid' on a MoE model" in out
    from pipeline.cli.train import plan_from_argv

    full = plan_from_argv(BASE[:-1] + ["--no-path-checks"]).preflight.memory_gb
    lora = plan_from_argv(BASE[:-1] + ["--no-path-checks", "--peft", "lora"]).preflight.memory_gb
    assert lora["grads"] == lora["optimizer"] == 0 and lora["total"] < full["total"] - 30


def test_keys_and_types_bridge_would_swallow(capsys):
    """Bridge's override code drops unknown keys and stores strings in int/bool fields (tests/bridge/ shows it);
    the preflight checks every Bridge-bound key and value against config/bridge_fields.json."""
    assert main(BASE + ["+model.tensor_model_paralel_size=2", "model.sequence_parallel=maybe",
                        "+train.exit_duration_in_mins=oops"]) == 2
    errs = errors(capsys)
    assert any("'model.tensor_model_paralel_size' is not a field of Megatron Bridge's nano sft config" in e
               and "did you mean 'model.tensor_model_parallel_size'" in e for e in errs), errs
    assert any("model.sequence_parallel='maybe' must be a boolean" in e for e in errs), errs
    assert main(BASE + ["+model.moe_router_dtype=fp32"]) == 0  # a real Bridge field passes through
    capsys.readouterr()
    assert main([NANO, "--model", "nano", "--mode", "pretrain", "--dry-run", "--nodes", "16", "--no-path-checks"]) == 2
    assert any("'dataset.dataset_root' is not a field of Megatron Bridge's nano pretrain config" in e
               for e in errors(capsys))


@pytest.mark.parametrize("override,needle", [
    ("logger.wandb_exp_name=2024", "logger.wandb_exp_name=2024 must be a string (quote it: logger.wandb_exp_name='2024')"),
    ("model.sequence_parallel=maybe", "model.sequence_parallel='maybe' must be a boolean"),
    ("optimizer.lr=1e-3,1e-4", "is a sweep (a,b / choice() / range() / glob())"),
    ("train.train_iters=range(1,3)", "is a sweep"),
    ("logger.wandb_exp_name=a/b", "cannot name a run directory"),
])
def test_typed_values_and_sweeps_on_the_local_engine(capsys, override, needle):
    argv = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--dry-run",
            "--no-path-checks", override]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("extra,needle", [
    (["+train.train_iter=5"], "'train.train_iter' is not a config key of either engine (did you mean 'train.train_iters'?)"),
    (["logger.wandb_exp_name=" + "x" * 300], "cannot name a run directory"),
    (["logger.wandb_exp_name=''"], "logger.wandb_exp_name='' is empty"),
    (["train.train_iters=99999999999999999999999"], "is out of range"),
    (["pipeline.local.autocast=fp16"], "pipeline.local.autocast='fp16' is not one of off, bf16, auto"),
])
def test_more_local_engine_refusals(capsys, extra, needle):
    argv = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--dry-run",
            "--no-path-checks", *extra]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_config_path_that_is_a_directory(capsys):
    assert main(["configs", "--model", "tiny-qwen3-moe", "--mode", "sft", "--dry-run"]) == 2
    assert "config file configs is a directory" in capsys.readouterr().err


def test_bf16_autocast_choice(monkeypatch):
    import torch

    from pipeline.config.schema import TrainingConfig
    from pipeline.training.engines.local import use_bf16_autocast

    def cfg(v):
        return TrainingConfig.from_dict({"pipeline": {"local": {"autocast": v}}})

    assert use_bf16_autocast(cfg("bf16")) and not use_bf16_autocast(cfg("off"))
    assert not use_bf16_autocast(TrainingConfig())
    for amx, avx in ((True, False), (False, True), (False, False)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda a=amx: a)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda a=avx: a)
        assert use_bf16_autocast(cfg("auto")) == (amx or avx)  # auto: only where the CPU computes bf16 natively


def test_auto_autocast_is_bf16_on_a_cuda_gpu_that_computes_it(monkeypatch):
    """Issue 47 item 3: ``autocast: auto`` trained fp32 on every CUDA machine. The decision is a pure function of
    the device and its facts, so the CUDA branch is tested here without a GPU; the CPU rule is unchanged."""
    import torch

    from pipeline.config.schema import TrainingConfig
    from pipeline.training.engines.local import bf16_autocast, use_bf16_autocast

    for cuda_bf16 in (True, False):
        for amx, avx in ((True, True), (False, False)):  # the CPU's facts do not decide on a GPU
            assert bf16_autocast("auto", "cuda", cuda_bf16=cuda_bf16, cpu_amx=amx, cpu_avx512_bf16=avx) == cuda_bf16
            assert bf16_autocast("auto", "cpu", cuda_bf16=cuda_bf16, cpu_amx=amx, cpu_avx512_bf16=avx) == amx
    for device in ("cuda", "cpu"):
        assert bf16_autocast("bf16", device, cuda_bf16=False, cpu_amx=False, cpu_avx512_bf16=False)
        assert not bf16_autocast("off", device, cuda_bf16=True, cpu_amx=True, cpu_avx512_bf16=True)
    assert bf16_autocast("auto", "cpu", cuda_bf16=False, cpu_amx=False, cpu_avx512_bf16=True)
    # the engine's own call reads the GPU's facts (an H100/GH200 computes bf16; a V100 does not)
    auto = TrainingConfig.from_dict({"pipeline": {"local": {"autocast": "auto"}}})
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported in (True, False):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, s=supported, **k: s)
        assert use_bf16_autocast(auto) == supported


TINY = ["configs/local/tiny_moe_sft.yaml", "--model", "tiny-qwen3-moe", "--mode", "sft", "--dry-run", "--no-path-checks"]


@pytest.mark.parametrize("argv,needle", [
    (TINY + ["optimizer.lr=" + "9" * 400], "is out of range"),  # no float holds it: once an OverflowError traceback
    (TINY + ["train.train_iters=" + "9" * 5000], "malformed override"),  # past Python's int-conversion limit
    (TINY + ["+pipeline.local.dtyp=bfloat16"], "'pipeline.local.dtyp' is not a config key: the pipeline section is "
                                               "the suite's own (did you mean 'pipeline.local.dtype'?)"),
    (TINY + ["env_vars={A:null}"], "env_vars.A=None must be a string or a number"),
    (TINY + ["dataset.num_workers=-1"], "dataset.num_workers=-1 must be >= 0"),
    (TINY + ["pipeline.local.autocast=false"], "is not one of off, bf16, auto (YAML reads off/on/yes/no unquoted as "
                                               "booleans: quote the word)"),
    (TINY + ["checkpoint.save=[a]"], "checkpoint.save=['a'] must be a string, not a list"),
    (BASE + ["mixed_precision=5"], "'mixed_precision' is a section of Megatron Bridge's config"),
    (BASE + ["+comm_overlap=5"], "'comm_overlap' is a section of Megatron Bridge's config"),
    (BASE + ["peft.dim=8"], "(the LoRA settings apply with --peft lora)"),
    (BASE + ["--peft", "lora", "peft.dropout=5.0"], "peft.dropout=5.0 is out of range [0, 1)"),
])
def test_hostile_values_are_one_line_each(capsys, argv, needle):
    """Found by a hostile review of the typed config (each was a traceback, a wrong message or a silent pass)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err[-2000:]


def test_a_mistyped_count_is_one_problem_and_null_keeps_a_default(capsys):
    assert main(TINY + ["train.train_iters=abc"]) == 2
    assert errors(capsys) == ["error: train.train_iters='abc' must be an integer"]  # not also "(0) must be >= 1"
    from pipeline.cli.train import plan_from_argv

    plan = plan_from_argv(TINY + ["pipeline.local.dtype=null", "pipeline.local.autocast=null"])
    assert plan.preflight.ok and plan.cfg.pipeline.local.dtype == "float32" and plan.cfg.pipeline.local.autocast == "off"


def test_the_out_of_memory_hint_does_not_ask_for_recompute_that_is_on(capsys):
    """Issue 33 item 5: with full recompute on, the hint names what is left to change."""
    assert main(BASE + ["model.recompute_granularity=full", "train.micro_batch_size=16"]) == 2
    line = next(e for e in errors(capsys) if "estimated memory" in e)
    assert "enable model.recompute_granularity=full" not in line and "full recompute is already on" in line
    assert main(BASE + ["model.recompute_granularity=null"]) == 2
    assert any("enable model.recompute_granularity=full" in e for e in errors(capsys))


def test_a_missing_nano_base_names_the_base_import(capsys):
    """Issue 33 item 5: the Nano configs start from the -Base-BF16 import, so the hint imports that model."""
    assert main(BASE[:-1] + ["checkpoint.pretrained_checkpoint=/no/such/base"]) == 2
    line = next(e for e in errors(capsys) if "/no/such/base does not exist" in e)
    assert "import nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16," in line, line


def test_forgetting_nodes_names_the_node_count_that_fits(capsys):
    """Issue 49 item 9: the Nano quickstart planned without --nodes (1 node) was refused as a memory overflow
    ("179.9 GB > 95") with hints about parallelism only; it needs more data-parallel ranks to shard its optimizer.
    The line now names the fewest nodes on which the same layout fits, and that count plans."""
    i = BASE.index("--nodes")
    argv = BASE[:i] + BASE[i + 2:]
    assert main(argv + ["--nodes", "1"]) == 2
    line = next(e for e in errors(capsys) if "estimated memory" in e)
    m = re.search(r"on 1 node\(s\) > 95 GB .* with this layout it needs --nodes (\d+) \(([\d.]+) GB per GPU there\)", line)
    assert m and float(m.group(2)) <= 95, line
    assert main(argv + ["--nodes", m.group(1)]) == 0, errors(capsys)
    assert main(argv + ["--nodes", str(int(m.group(1)) - 1)]) == 2  # one fewer does not fit (or does not divide)


def test_no_single_field_range_check_outside_the_schema():
    """Issue 63, item 2: each value's own bounds live in the schema's field metadata (config/schema._f), checked at
    load; the preflight and the profiling checks keep only rules between values. Walks their code for an ``if`` that
    compares a config field (an attribute named like a numeric field of the schema) with a number and appends a
    problem: none."""
    import ast
    import dataclasses
    import typing

    from pipeline.config import schema
    from tests.helpers import ROOT

    numeric: set[str] = set()

    def walk(cls):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp)
            elif set(typing.get_args(tp) or (tp,)) & {int, float}:
                numeric.add(f.name)

    walk(schema.TrainingConfig)
    assert {"lr", "save_interval", "dropout", "profile_step_start", "tensor_model_parallel_size"} <= numeric

    def bound_check(test: ast.AST) -> bool:
        for c in ast.walk(test):
            if isinstance(c, ast.Compare) and any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in c.ops):
                sides = [c.left, *c.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr in numeric for s in sides) and any(
                        isinstance(s, ast.Constant) and isinstance(s.value, (int, float)) for s in sides):
                    return True
        return False

    found = []
    for rel in ("src/pipeline/training/preflight.py", "src/pipeline/training/profiling.py"):
        text = (ROOT / rel).read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.If) and bound_check(node.test) and "append" in ast.unparse(node.body[0]):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node.test)}")
        # and the messages of a bound, whatever the code's shape (a loop over (key, value, low) tuples had them)
        found += [f"{rel}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
                  for m in re.finditer(r"must be (?:>=|>|<=|<) -?\d|must be in [\[(]", text)]
    assert found == []
