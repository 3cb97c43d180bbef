# IMPORT SHIM (Bridge harness only): stand-in for Hugging Face diffusers, served only to Bridge's
# megatron/bridge/diffusion/ modules (Flux/Wan bridges, imported at package import; see
# ../../sitecustomize.py). Every name is a class that cannot be instantiated.
# No test assertion may rest on anything this shim provides.


def placeholder(module, name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _init(self, *args, **kwargs):
        raise RuntimeError(f"diffusers.{name} is an import shim in the Bridge harness")

    return type(name, (), {"__init__": _init, "__module__": module})
