# The Makefile of megatron-core's dataset helpers, placed as megatron/core/datasets/Makefile in every install of
# the pinned megatron-core wheel that the suite makes (the container overlay, the container twin, the Bridge
# harness, the GPU ready check's wheels): `python src/pipeline/env/overlay.py complete SITE` (decision 90).
#
# Why: Megatron Bridge's initialize_megatron() calls megatron-core's compile_helpers() on local rank 0 of every
# node, which runs `make -C <megatron/core/datasets>` and calls sys.exit(1) when make fails. The megatron-core
# 0.19.2 wheels ship the prebuilt helpers_cpp<suffix>.so beside helpers.cpp but no Makefile (nor does its sdist:
# its setup.py builds the extension instead), so without this file every Bridge training exits 1 in its setup.
#
# What it does: the default target is helpers_cpp<the running Python's extension suffix>. The wheel's prebuilt
# library is the build of the helpers.cpp it ships with, so it is an order-only prerequisite: when the library
# for this Python is there, make has nothing to do and writes nothing (a read-only shared overlay stays intact);
# when it is missing (another Python than the wheel's), it is built with the flags of megatron-core's own
# setup.py (-O3 -Wall -std=c++17, pybind11's headers), into a temporary name renamed into place, so a rank of
# another node never loads a half-written library. A Python that cannot be run is an error, not an empty suffix.
PYTHON ?= python3
EXT_SUFFIX := $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX") or "")' 2>/dev/null)
ifeq ($(strip $(EXT_SUFFIX)),)
$(error megatron-core dataset helpers: '$(PYTHON)' cannot report its extension suffix; set PYTHON=/path/to/python3)
endif
TARGET := helpers_cpp$(EXT_SUFFIX)

.PHONY: default
default: $(TARGET)

$(TARGET): | helpers.cpp
	$(CXX) -O3 -Wall -shared -std=c++17 -fPIC $$($(PYTHON) -m pybind11 --includes) helpers.cpp -o $@.tmp.$$$$ \
		&& mv -f $@.tmp.$$$$ $@ || { rm -f $@.tmp.$$$$; exit 1; }
