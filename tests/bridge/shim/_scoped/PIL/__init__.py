# IMPORT SHIM (Bridge harness only): stand-in for Pillow, served only to megatron-energon's image
# transforms (see ../../sitecustomize.py), which name PIL.Image in annotations.
# No test assertion may rest on anything this shim provides.
from . import Image  # noqa: F401
from .Image import UnidentifiedImageError  # noqa: F401,E402
