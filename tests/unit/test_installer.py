"""uv gets pip's sources (pipeline.env.installer): the same wheels from the same places."""

import importlib.util

from pipeline.common import paths

spec = importlib.util.spec_from_file_location("installer", paths.repo_root() / "src/pipeline/env/installer.py")
installer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(installer)  # run by path in the setup, before the suite is installed: loaded the same way


def test_pip_config_becomes_uv_options():
    listing = "\n".join([
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.find-links='/opt/wheels'",
        ":env:.find-links='/opt/wheels'",  # the same folder from PIP_FIND_LINKS: once
        "global.index-url='https://mirror.example/simple'",
        ":env:.index-url='https://other.example/simple'",  # the environment wins, as in pip
        "global.timeout='60'",
    ])
    assert installer.uv_sources(listing) == [
        "--index-strategy", "unsafe-best-match",
        "--index-url", "https://other.example/simple",
        "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/xdg/pip/constraints.txt",
    ]


def test_no_pip_configuration_means_pypi_with_pips_rule():
    assert installer.uv_sources("") == ["--index-strategy", "unsafe-best-match"]
    assert installer.uv_sources("not a config line\n") == ["--index-strategy", "unsafe-best-match"]
