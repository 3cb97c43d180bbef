# IMPORT SHIM (Bridge harness only): stand-in for NVIDIA multi-storage-client, served only to
# megatron-energon (Bridge's multimodal data loader, imported by Bridge at module level; see
# ../../sitecustomize.py). Energon names these types in annotations; nothing here does I/O.
# No test assertion may rest on anything this shim provides.
from . import types  # noqa: F401


class StorageClient:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("multistorageclient is an import shim in the Bridge harness")


def resolve_storage_client(*args, **kwargs):
    raise RuntimeError("multistorageclient is an import shim in the Bridge harness")
