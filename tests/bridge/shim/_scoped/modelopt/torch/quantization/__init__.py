# IMPORT SHIM (Bridge harness only): see modelopt/__init__.py. No test assertion may rest on it.
