# IMPORT SHIM (Bridge harness only): see __init__.py. No test assertion may rest on it.
class ObjectMetadata:
    pass
