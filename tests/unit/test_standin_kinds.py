"""The megatron_cpu tier's stand-ins follow the tier's rule (decision 90): every patch is a CUDA call mapped onto
the CPU ([cuda]) or a GPU kernel mapped onto its library's own reference implementation ([kernel]), classified in
its file's header; nothing else is stood in. Read from the stand-ins' source (no venv needed); the tier's own test
(tests/megatron_cpu/test_megatron_cpu.py) checks the same of what the stand-ins really patched at run time."""

from __future__ import annotations

import ast
import re

import pytest

from tests.helpers import ROOT

STANDIN = ROOT / "tests" / "megatron_cpu" / "standin"
FILES = sorted(STANDIN.glob("*.py"))
KINDS = {"cuda", "kernel"}
# What the tier once stood in and now runs for real (fixed in the product or installed as on the cluster): the
# stand-ins' code must not name them again.
RUN_FOR_REAL = ("compile_helpers", "CallWrapper", "_warmup_jit_function", "nvidia_resiliency_ext", "meta_path",
                "helpers_cpp")


def header(path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def patch_calls(path) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == "_patch"]


def test_the_stand_in_files_are_the_three_known():
    assert [f.name for f in FILES] == ["mamba_standin.py", "sitecustomize.py", "training_standin.py"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_patch_names_an_allowed_kind(path):
    calls = patch_calls(path)
    assert calls, f"{path.name} patches nothing?"
    for call in calls:
        if any(isinstance(a, ast.Starred) for a in call.args):
            continue  # the definition's own forwarding, if any
        assert len(call.args) == 5, f"{path.name}:{call.lineno}: _patch(owner, name, value, label, kind)"
        kind = call.args[4]
        assert isinstance(kind, ast.Constant) and kind.value in KINDS, \
            f"{path.name}:{call.lineno}: kind {ast.unparse(kind)} is not one of {sorted(KINDS)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_patch_is_classified_in_the_header(path):
    """Each patched attribute is named on a header line tagged with its kind, and the header tags no other kind."""
    head = header(path)
    tags = set(re.findall(r"^#\s+\[(\w+)\]", head, flags=re.M))
    assert tags and tags <= KINDS, f"{path.name}'s header tags {tags}"
    entries: dict[str, str] = {}  # kind -> the text of its header entries
    current = None
    for line in head.splitlines():
        m = re.match(r"^#\s+\[(\w+)\]\s+(.*)", line)
        if m:
            current = m.group(1)
            entries[current] = entries.get(current, "") + " " + m.group(2)
        elif current and re.match(r"^#\s{6,}\S", line):
            entries[current] += " " + line.lstrip("# ")
        else:
            current = None
    for call in patch_calls(path):
        if len(call.args) != 5:
            continue
        name, label, kind = call.args[1], call.args[3], call.args[4].value
        if isinstance(name, ast.Constant) and name.value != "torch":
            words = [name.value]
        else:  # a variable attribute, or a module's torch (scoped factories): the label's fixed words name it
            text = label.value if isinstance(label, ast.Constant) else "".join(
                v.value for v in label.values if isinstance(v, ast.Constant))
            words = [w for w in re.findall(r"[A-Za-z_][\w<>]*(?:\.[\w<>]+)*", text) if len(w) > 4]
            words = [w.split(".")[-1] if w.count(".") > 1 else w for w in words]
        for word in words:
            assert word in entries.get(kind, ""), f"{path.name}:{call.lineno}: {word} is not in a [{kind}] header entry"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_what_runs_for_real_is_not_stood_in(path):
    code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    for name in RUN_FOR_REAL:
        assert name not in code, f"{path.name} stands in for {name}, which the tier runs for real"


# ---- the Bridge harness's import shim, which the tier chains (issue 58 item 4) ---------------------------------
SHIM = ROOT / "tests" / "bridge" / "shim" / "sitecustomize.py"
SHIM_KINDS = {"kernel", "image"}
# the import name of each package the shim stands in for -> its distribution in the image's package list
IMAGE_DISTRIBUTIONS = {"multistorageclient": "multi-storage-client", "ryml": "rapidyaml", "PIL": "pillow",
                       "diffusers": "diffusers", "modelopt": "nvidia-modelopt", "triton": "triton",
                       "transformer_engine": "transformer-engine", "selective_scan_cuda": "mamba-ssm",
                       "causal_conv1d_cuda": "causal-conv1d"}


def _shim_scoped() -> dict:
    tree = ast.parse(SHIM.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_SCOPED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("the shim defines no _SCOPED table")


def test_every_package_the_shim_stands_in_for_is_classified():
    """Each scoped stand-in of the harness shim is tagged in its header: [kernel] (GPU kernels the tier does not run:
    Triton, Transformer Engine) or [image] (a package the cluster's image holds, imported for paths the tier does not
    run); nothing else, and every one of them is in the image's package list, so none of them can be missing on the
    cluster."""
    from pipeline.env.closure import IMAGE_LIST, NVIDIA_PROVIDED, read_freeze

    head = header(SHIM)
    tagged: dict[str, str] = {}
    for kind, text in re.findall(r"^#\s+\[(\w+)\]\s+(.*(?:\n#\s{6,}\S.*)*)", head, flags=re.M):
        assert kind in SHIM_KINDS, f"the shim's header tags [{kind}]"
        names = re.split(r"[:]", text, maxsplit=1)[0]
        for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", names):
            tagged[name] = kind
    scoped = _shim_scoped()
    assert set(scoped) <= set(tagged), f"untagged shim stand-ins: {sorted(set(scoped) - set(tagged))}"
    image = {n.lower() for n in read_freeze(IMAGE_LIST)}
    for name in scoped:
        dist = IMAGE_DISTRIBUTIONS[name]
        # (NVIDIA's own builds in the image, whose presence validate --run-training checks on the cluster, count:
        # a Nano or Super run on an image without mamba-ssm or causal-conv1d is refused on the login node)
        assert dist in image or dist in NVIDIA_PROVIDED, \
            f"{name} ({dist}) is not in {IMAGE_LIST.name}: on the cluster it would be missing too"
    assert {n for n, k in tagged.items() if k == "kernel"} == {"triton", "transformer_engine", "selective_scan_cuda",
                                                               "causal_conv1d_cuda"}
