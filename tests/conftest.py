import os
import tempfile

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_basetemp(tmp_path_factory):
    """Every temporary file of the run (ours, and what torch, the elastic agent or a tool makes in its
    processes) goes under pytest's basetemp, so a test run leaves nothing else in /tmp."""
    tmp = tmp_path_factory.getbasetemp() / "tmp"
    tmp.mkdir(exist_ok=True)
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(tmp), str(tmp)
    yield
    if saved[0] is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
