# IMPORT SHIM (Bridge harness only): stand-in for NVIDIA Model Optimizer (nvidia-modelopt), served only
# to megatron.bridge modules (see ../../sitecustomize.py). Bridge imports it unguarded for quantization /
# distillation, which the harness never uses. No test assertion may rest on anything this shim provides.
