"""Print uv.lock's registry packages as pip constraints (``name==version ; markers``): what `make install`
falls back to when uv is unavailable, so plain pip installs the same versions as uv.

    python tools/lock_constraints.py uv.lock > constraints.txt

A package resolved differently for different environments (numpy for Python 3.11 and for 3.12+) appears once
per fork, under that fork's markers. The project itself (an editable source) is not listed.
"""

from __future__ import annotations

import sys
import tomllib


def constraints(lock: dict) -> list[str]:
    lines = []
    for p in lock["package"]:
        if "registry" not in p.get("source", {}):
            continue
        markers = " or ".join(f"({m})" for m in p.get("resolution-markers", []))
        lines.append(f"{p['name']}=={p['version']}" + (f" ; {markers}" if markers else ""))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/lock_constraints.py uv.lock", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        print("\n".join(constraints(tomllib.load(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
