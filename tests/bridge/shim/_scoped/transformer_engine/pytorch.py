# IMPORT SHIM (Bridge harness only): stand-in for transformer_engine.pytorch. The classes exist so that
# `isinstance(x, (te.Linear, te.LayerNormLinear))` in Bridge's LoRA code is False for local layers;
# nothing can be built from them. No test assertion may rest on anything this shim provides.


class _NotAvailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("Transformer Engine is an import shim in the Bridge harness (CPU)")


class Linear(_NotAvailable):
    pass


class LayerNormLinear(_NotAvailable):
    pass


def fp8_autocast(*args, **kwargs):
    raise RuntimeError("Transformer Engine is an import shim in the Bridge harness (CPU)")


class ops:  # noqa: N801 - mirrors the submodule `te.ops`, named in annotations only
    class Sequential(_NotAvailable):
        pass
