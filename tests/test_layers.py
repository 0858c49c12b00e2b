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


def test_no_module_of_the_package_imports_the_tests():
    """Every import of every module under dgc/ and tasks/ (read with ast, not sampled): none names ``tests``, which a
    wheel does not ship (``make gpu-check``'s data writers live in dgc.tasks.tiny_data)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted([*root.joinpath("dgc").rglob("*.py"), *root.joinpath("tasks").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "tests"]
    assert found == []
