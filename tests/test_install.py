"""`make install`'s pieces: uv.lock pins what pyproject.toml pins, the pip fallback gets the same versions
from it, this environment is the locked one, and the script's mistakes are one line."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LOCK = tomllib.loads((ROOT / "uv.lock").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT, TOOL_UV = PYPROJECT["project"], PYPROJECT["tool"]["uv"]

sys.path.insert(0, str(ROOT / "tools"))
import lock_constraints  # noqa: E402


def applies(line: str) -> bool:
    req = Requirement(line)
    return req.marker is None or req.marker.evaluate()


def test_the_lock_pins_what_pyproject_pins() -> None:
    """The application's stack is pinned for uv.lock ([tool.uv] constraint-dependencies), not in the published
    requirements: the library asks for torch alone, with a lower bound."""
    locked = {p["name"]: p["version"] for p in LOCK["package"] if "registry" in p.get("source", {})}
    pins = [Requirement(r) for r in TOOL_UV["constraint-dependencies"]]
    assert {r.name for r in pins} >= {"torch", "torchvision", "torchaudio"}
    for r in pins:
        assert locked[r.name] == str(r.specifier).removeprefix("=="), r.name
    assert [Requirement(r).name for r in PROJECT["dependencies"]] == ["torch"]
    assert not any("==" in r for extra in PROJECT["optional-dependencies"].values() for r in extra)


def test_the_pip_fallback_installs_the_locked_versions() -> None:
    lines = lock_constraints.constraints(LOCK)
    assert "torch==2.11.0" in lines and "torchaudio==2.11.0" in lines and "torchvision==0.26.0" in lines
    assert all(Requirement(line) for line in lines)  # pip's syntax, markers included
    # a package resolved per Python version appears once per fork; exactly one applies here
    numpy = [line for line in lines if line.startswith("numpy==")]
    assert len(numpy) >= 2 and sum(map(applies, numpy)) == 1
    assert Marker("python_full_version < '3.12'").evaluate() == (sys.version_info < (3, 12))
    assert not any(line.startswith("dgc==") for line in lines)  # the project itself is installed editable


def test_this_environment_is_the_locked_one() -> None:
    wanted = {Requirement(line).name: line for line in lock_constraints.constraints(LOCK) if applies(line)}
    for name in ("torch", "torchvision", "torchaudio", "hydra-core", "numpy", "scipy", "pytest"):
        assert Requirement(wanted[name]).specifier.contains(importlib.metadata.version(name)), name


def test_install_script_mistakes_are_one_line() -> None:
    out = subprocess.run(["bash", str(ROOT / "tools" / "install.sh"), "--bogus"], capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == "install: unknown argument --bogus (valid: --print-uv, or none)"


def test_the_readme_says_how_to_pick_another_torch_build() -> None:
    """A CPU-only machine gets the lock's CUDA build of torch: README's "Which torch build" replaces it with the
    locked versions from PyTorch's CPU index, and the install script's last line points there."""
    import re

    readme = (ROOT / "README.md").read_text()
    start = readme.index("### Which torch build")
    text = readme[start : readme.index("\n##", start + 1)]  # to the next heading
    (block,) = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    locked = {p["name"]: p["version"] for p in LOCK["package"] if p["name"] in ("torch", "torchvision", "torchaudio")}
    command = block.split("\n#")[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in command and "--python .venv/bin/python" in command
    assert command.startswith("$(tools/install.sh --print-uv) pip install ")
    for name, version in locked.items():
        assert f"{name}=={version}+cpu" in command, name
    assert "whl/cu128" in block and "make -o install" in text and "Untested here" in text
    script = (ROOT / "tools" / "install.sh").read_text()
    assert 'see README.md, \\"Which torch build\\"' in script
