# IMPORT SHIM (Bridge harness only): stand-in for Transformer Engine, served only to Bridge's
# megatron/bridge/peft/lora_layers.py (see ../../sitecustomize.py). Nothing here runs TE code.
# No test assertion may rest on anything this shim provides.
__version__ = "0.0.0+harness-shim"
