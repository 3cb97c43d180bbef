# IMPORT SHIM (Bridge harness only): stand-in for rapidyaml's `ryml`, served only to megatron-energon
# (see ../sitecustomize.py), which names ryml.Tree in annotations. Parsing raises.
# No test assertion may rest on anything this shim provides.
class Tree:
    pass


def parse_in_arena(*args, **kwargs):
    raise RuntimeError("ryml is an import shim in the Bridge harness")


def children(*args, **kwargs):
    raise RuntimeError("ryml is an import shim in the Bridge harness")
