import os
import tempfile

import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Every temporary file of the run goes under pytest's basetemp, so a test run leaves nothing else in
    /tmp: ours, and what torch (``torchinductor_$USER`` on importing torchvision), the elastic agent or a
    tool makes in the tests' processes. Set before any test module imports torch."""
    tmp = config._tmp_path_factory.getbasetemp() / "tmp"
    tmp.mkdir(exist_ok=True)
    config._dgc_saved_tmpdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(tmp), str(tmp)


def pytest_unconfigure(config):
    saved = getattr(config, "_dgc_saved_tmpdir", None)
    if saved is not None:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
