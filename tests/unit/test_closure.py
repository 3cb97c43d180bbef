"""The container closure (pipeline.env.closure): image + overlay satisfy every requirement of the pinned Megatron
Bridge and megatron-core, every overlay pin is needed and has its reason, and every pin has a CPython 3.12 wheel
for the GH200 nodes (linux aarch64) as well as for x86_64. The pinned wheels come from PyPI (tier twin)."""

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from pipeline.common.errors import UserError
from pipeline.env import closure
from tests.helpers import ROOT
from tests.tiers import tier_unavailable

WHEELS = ROOT / ".cache" / "wheels"
# The overlay as it was before issue 20: NVRx 0.4.1 shadowed the image's 0.6.0 and crashed `import megatron.core`.
OLD_OVERLAY = """\
# The training engine.
megatron-bridge==0.6.2
# Its megatron-core.
megatron-core==0.19.2
nvidia-resiliency-ext==0.4.1
# JSONL.
orjson==3.13.0
"""


def run_check(overlay: Path, machine: str = "x86_64") -> list[str]:
    pins = closure.read_overlay(overlay)
    try:
        requires = closure.overlay_requires(pins, WHEELS, machine)
    except UserError as exc:
        if "has no wheel" in str(exc) and ("connection" in str(exc).lower() or "network" in str(exc).lower()):
            tier_unavailable("twin", f"cannot download the overlay's wheels from PyPI: {exc}")
        raise
    return closure.check(closure.read_freeze(closure.IMAGE_LIST), pins, requires,
                         closure.local_pins(closure.SUITE_NEEDS), machine)


@pytest.mark.twin
@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_todays_overlay_closes_over_the_recorded_image(machine):
    """Every pin has a CPython 3.12 wheel for the machine (aarch64: the GH200 nodes), and nothing is missing,
    mismatched, stale or unexplained."""
    assert run_check(closure.OVERLAY, machine) == []


@pytest.mark.twin
def test_the_old_overlay_is_refused_with_each_reason(tmp_path):
    old = tmp_path / "requirements-container.txt"
    old.write_text(OLD_OVERLAY)
    problems = run_check(old)
    assert ("megatron-core[dev]==0.19.2 requires nvidia-resiliency-ext==0.6.0, but the overlay has "
            "nvidia-resiliency-ext 0.4.1 first on the path; remove nvidia-resiliency-ext from the overlay: the "
            "image's 0.6.0 satisfies it") in problems
    assert ("megatron-bridge==0.6.2 requires transformers<=5.12.1,>=5.8, but the image has transformers 5.24.0 "
            "first on the path; pin a matching transformers in the overlay") in problems
    assert "overlay pin nvidia-resiliency-ext==0.4.1 has no reason: write one on the comment line above it" in problems


# ---- the rules on synthetic metadata (no download) ----------------------------------------------------------
def pins(tmp_path, text: str) -> list[closure.Pin]:
    f = tmp_path / "overlay.txt"
    f.write_text(text)
    return closure.read_overlay(f)


def reqs(*lines: str) -> list[Requirement]:
    return [Requirement(x) for x in lines]


IMAGE = {"numpy": Version("2.3.5"), "tqdm": Version("4.70.1"), "torch": Version("2.13.0a0+nv26.6"),
         "hub": Version("2.4.0"), "datasets": Version("5.2.0")}


def test_missing_mismatched_and_provided(tmp_path):
    overlay = pins(tmp_path, "# the engine\nengine==1.0\n")
    requires = {"engine": reqs("numpy>=2", "tqdm<4", "torch>=2.6", "absent", 'gpu-only; sys_platform == "win32"',
                               'extra-dep; extra == "dev"')}
    problems = closure.check(IMAGE, overlay, requires)
    assert problems == [
        "engine==1.0 requires tqdm<4, but the image has tqdm 4.70.1 first on the path; pin a matching tqdm in the "
        "overlay",
        "engine==1.0 requires absent, which neither the image nor the overlay has: pin it in "
        "requirements-container.txt (with its reason) or use an image that has it"]  # torch: NVIDIA's, provided


def test_extras_are_walked_through_overlay_packages(tmp_path):
    overlay = pins(tmp_path, "# a\ntop==1\n# b\ncore==2\n")
    requires = {"top": reqs("core[dev]"), "core": reqs("numpy", 'needs-dev>=1; extra == "dev"')}
    assert closure.check(IMAGE, overlay, requires) == [
        "core[dev]==2 requires needs-dev>=1, which neither the image nor the overlay has: pin it in "
        "requirements-container.txt (with its reason) or use an image that has it"]


def test_a_pin_the_image_already_satisfies_is_stale(tmp_path):
    overlay = pins(tmp_path, "# the engine\nengine==1.0\n# old copy\nnumpy==2.0.0\n\nnoreason==1\n")
    requires = {"engine": reqs("numpy>=1.26"), "numpy": [], "noreason": []}
    assert closure.check(IMAGE, overlay, requires) == [
        "overlay pin numpy==2.0.0 is not needed: the image's numpy 2.3.5 satisfies every requirement on it (an older "
        "copy first on the path shadows the image's); remove it from requirements-container.txt",
        "overlay pin noreason==1 has no reason: write one on the comment line above it"]


def test_an_overlay_downgrade_that_breaks_an_image_package(tmp_path):
    overlay = pins(tmp_path, "# the engine\nengine==1.0\n# engine needs hub 1.x\nhub==1.33.0\n")
    requires = {"engine": reqs("hub<2"), "hub": []}
    image_requires = {"datasets": reqs("hub>=2.0", 'hub<1; python_version < "3"'), "hub": reqs("numpy")}
    assert closure.check(IMAGE, overlay, requires, image_requires=image_requires) == [
        "the image's datasets 5.2.0 requires hub>=2.0, but the overlay's hub==1.33.0 shadows the image's hub; "
        "choose a pin both accept"]


def test_the_suite_needs_count_as_requirements(tmp_path):
    overlay = pins(tmp_path, "# JSONL bytes as in the venv\norjson==3.13.0\n")
    image = {**IMAGE, "orjson": Version("3.10.0")}
    assert closure.check(image, overlay, {"orjson": []}, reqs("orjson==3.13.0")) == []
    assert closure.check({**IMAGE, "orjson": Version("3.13.0")}, overlay, {"orjson": []}, reqs("orjson==3.13.0")) == [
        "overlay pin orjson==3.13.0 is not needed: the image's orjson 3.13.0 satisfies every requirement on it; "
        "remove it from requirements-container.txt"]


@pytest.mark.parametrize("text,needle", [
    ("torch>=2\n", "overlay pins are exact (NAME==VERSION)"),
    ("x==not a version\n", "'not a version' is not a version"),
])
def test_bad_overlay_lines_are_one_line(tmp_path, text, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        pins(tmp_path, text)


def test_the_recorded_image_list_parses_and_says_how_to_record_it():
    image = closure.read_freeze(closure.IMAGE_LIST)
    assert image["nvidia-resiliency-ext"] == Version("0.6.0") and "torch" in image and len(image) > 100
    text = closure.IMAGE_LIST.read_text()
    assert 'apptainer exec "$PIPELINE_SIF" python -m pip list --format=freeze > 3rdparty/image-packages.txt' in text


def test_validates_record_of_the_image_is_what_the_closure_reads(tmp_path, monkeypatch, capsys):
    """validate's image-packages writes what the running image holds beside its SIF; the closure check reads that
    record in place of the repository's provisional list, and says so (issue 47). Without a SIF: the repository's."""
    monkeypatch.delenv("PIPELINE_SIF", raising=False)
    assert closure.image_record() is None and closure.default_image_list() == closure.IMAGE_LIST
    sif = tmp_path / "nemo.sif"
    monkeypatch.setenv("PIPELINE_SIF", str(sif))
    assert closure.default_image_list() == closure.IMAGE_LIST  # nothing recorded yet
    image = closure.read_freeze(closure.IMAGE_LIST)
    image.pop("sacrebleu", None)
    image["pyarrow"] = Version("99.0")
    record = closure.record_image(image, closure.image_record(), "nvcr.io/nvidia/nemo:26.06")
    assert record == tmp_path / "nemo.sif.packages.txt" and closure.default_image_list() == record
    assert closure.read_freeze(record) == image
    assert record.read_text().startswith("# The packages of nvcr.io/nvidia/nemo:26.06, recorded by")
    diff = closure.diff_lists(closure.read_freeze(closure.IMAGE_LIST), closure.read_freeze(record))
    assert any("pyarrow" in d for d in diff)


def test_the_harness_venv_has_the_suites_container_needs():
    """The Bridge harness venv stands for the container (image + overlay): the suite's own needs there (orjson, which
    the data modules the engine imports use) are in it at the overlay's pins, or every Bridge job dies on import."""
    harness = {Requirement(line).name.lower(): Requirement(line) for line in
               (ROOT / "tests" / "bridge" / "requirements.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    overlay = {p.name: p for p in closure.read_overlay(closure.OVERLAY)}
    for name in closure.SUITE_NEEDS:
        assert name in harness, f"{name} is missing from tests/bridge/requirements.txt"
        assert str(harness[name].specifier) == f"=={overlay[name].version}", name
