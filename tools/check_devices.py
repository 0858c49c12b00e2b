"""Static check (``make lint``): every tensor the library builds from Python values says on which device.

    python tools/check_devices.py            # the library's compute and exchange path (see PATHS)
    python tools/check_devices.py FILE...    # these files

A factory call (``torch.tensor``, ``zeros``, ``empty``, ``full``, ``arange``, ...) without ``device=`` builds
on the CPU whatever device the gradients are on: under NCCL such a tensor fails the first collective it
reaches (tests/test_devices.py catches the same at run time). Build it on the gradients' device, or say
``device="cpu"`` for a host value made on purpose. Prints ``file:line: ...`` per call; exits 1 if any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the modules a training step runs through (not the benches, the cost model or the trainer's bookkeeping)
PATHS = [*sorted((ROOT / "dgc").glob("*.py")), *sorted((ROOT / "dgc" / "compressors").glob("*.py"))]
SKIP = {"costmodel.py", "train.py"}
FACTORIES = {"tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "eye", "linspace", "rand", "randn",
             "randint", "randperm", "empty_strided"}  # fmt: skip


def problems(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        if any(k.arg == "device" or k.arg is None for k in node.keywords):  # device=..., or **kwargs
            continue
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        found.append(f"{name}:{node.lineno}: torch.{f.attr} without device= "
                     "(use the gradients' device; device='cpu' for a host value)")  # fmt: skip
    return found


def main(argv: list[str]) -> int:
    files = [Path(a) for a in argv] if argv else [p for p in PATHS if p.name not in SKIP]
    found = [line for p in files for line in problems(p)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
