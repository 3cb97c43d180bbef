# IMPORT SHIM (Bridge harness only): stand-in for NVIDIA Model Optimizer (nvidia-modelopt), served only
# to megatron.bridge modules (see ../../sitecustomize.py). Bridge imports it unguarded for quantization /
# distillation, which the harness never uses. No test assertion may rest on anything this shim provides.
# DistillationModel: Bridge's gpt_step asks isinstance(model, mtd.DistillationModel) for every loss function; no
# model here is one (the class is never instantiated), so Bridge takes its plain next-token loss.
from . import plugins  # noqa: E402,F401


class DistillationModel:
    """Stand-in class: no model the harness builds is a ModelOpt DistillationModel."""
