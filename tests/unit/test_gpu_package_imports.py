"""validate's gpu-packages check imports what megatron-core imports (issue 58, item 4): megatron-core's mamba_mixer
wraps ``from mamba_ssm.ops.triton.ssd_combined import ...`` (and layernorm_gated, causal_conv1d's varlen module) in
try/except ImportError and quietly sets HAVE_MAMBA_SSM = False, so a package whose top level imports but whose
submodule does not passed validate and failed the first Nano run in MambaMixer.__init__ after the queue. Here: a
mamba_ssm whose top level imports and whose Triton submodule does not (as a build without its kernels' sources
would be), on sys.path for this test only."""

from __future__ import annotations

import sys

import pytest

from pipeline import bridge


@pytest.fixture
def broken_mamba(tmp_path, monkeypatch):
    pkg = tmp_path / "mamba_ssm"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "2.3.2.post1"\n')
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "layernorm_gated.py").write_text("class RMSNorm:\n    pass\n")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text("import selective_scan_cuda  # the compiled kernels\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("mamba_ssm")]:
        monkeypatch.delitem(sys.modules, name)
    return pkg


def test_a_mamba_package_whose_submodule_fails_is_missing(broken_mamba):
    pkg = bridge.GpuPackage("mamba_ssm", None, "Mamba layers", ("nano sft",))
    import mamba_ssm  # the top-level import an old check trusted

    assert mamba_ssm.__version__ == "2.3.2.post1"
    with pytest.raises(ImportError, match=r"megatron-core imports mamba_ssm\.ops\.triton\.ssd_combined\."
                                          r"mamba_chunk_scan_combined: No module named 'selective_scan_cuda'"):
        bridge.import_gpu_package(pkg)
