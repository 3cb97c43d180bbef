# IMPORT SHIM (Bridge harness only): see __init__.py. No test assertion may rest on it.
class Image:
    pass


class UnidentifiedImageError(OSError):
    pass


def open(*args, **kwargs):  # noqa: A001 - mirrors PIL.Image.open
    raise RuntimeError("PIL is an import shim in the Bridge harness")
