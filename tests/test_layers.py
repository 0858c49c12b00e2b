"""The layers of the package, checked in a fresh interpreter: the library core imports neither Hydra nor omegaconf
nor the reproduction framework, and the tasks do not import the framework that runs them."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import dgc, dgc.compressors, dgc.exchanges, dgc.costmodel, dgc.hook, dgc.localbus
above = ("dgc.repro", "dgc.bench", "dgc.tasks")
core = sorted(m for m in sys.modules if m.split(".")[0] in ("hydra", "omegaconf") or m.startswith(above))
import dgc.tasks, dgc.tasks.classification, dgc.tasks.language_modeling, dgc.tasks.speech_recognition
tasks = sorted(m for m in sys.modules if m.startswith("dgc.repro"))
print(json.dumps({"core": core, "tasks": tasks}))
"""


def test_the_library_core_and_the_tasks_import_nothing_above_them():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found == {"core": [], "tasks": []}
