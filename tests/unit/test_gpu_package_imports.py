"""validate's gpu-packages check imports what megatron-core imports (issue 58, item 4): megatron-core's mamba_mixer
wraps ``from mamba_ssm.ops.triton.ssd_combined import ...`` (and layernorm_gated, causal_conv1d's varlen module) in
try/except ImportError and quietly sets HAVE_MAMBA_SSM = False, so a package whose top level imports but whose
submodule does not passed validate and failed the first Nano run in MambaMixer.__init__ after the queue. Here: a
mamba_ssm whose top level imports and whose Triton submodule does not (as a build without its kernels' sources
would be), first on the import path of a child interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# the check as validate runs it, in a child interpreter whose path starts with the broken package (the test's own
# interpreter keeps its import path)
CHILD = """
from pipeline import bridge
import mamba_ssm  # the top-level import an old check trusted

assert mamba_ssm.__version__ == "2.3.2.post1"
try:
    bridge.import_gpu_package(bridge.GpuPackage("mamba_ssm", None, "Mamba layers", ("nano sft",)))
except ImportError as exc:
    print(exc)
else:
    print("imported")
"""


@pytest.fixture
def broken_mamba(tmp_path):
    pkg = tmp_path / "mamba_ssm"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "2.3.2.post1"\n')
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "layernorm_gated.py").write_text("class RMSNorm:\n    pass\n")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text("import selective_scan_cuda  # the compiled kernels\n")
    return pkg


def test_a_mamba_package_whose_submodule_fails_is_missing(broken_mamba):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(broken_mamba.parent),
                                                                    os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ("megatron-core imports mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined: "
                                  "No module named 'selective_scan_cuda'"), res.stdout
