# IMPORT SHIM (Bridge harness only): stand-in for triton.language, which megatron-core's kernel modules
# use only in annotations and kernel bodies that never run on CPU. Every attribute is an inert
# placeholder. No test assertion may rest on anything this shim provides.


class _Placeholder:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<triton.language shim {self.name}>"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name)
