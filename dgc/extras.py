"""The optional parts of the package and what each needs beyond torch (pyproject.toml's extras).

The library (``import dgc``) needs torch alone. The reproduction framework (``python -m dgc.train``,
``dgc.repro``, ``dgc.bench``) needs the ``repro`` extra, the speech tasks the ``speech`` extra. Where one is
missing, :func:`require` says so in one line, naming the extra to install, instead of an import traceback.
"""

from __future__ import annotations

import importlib.util
import sys

#: extra -> the modules it provides (import names)
EXTRAS = {
    "repro": ("hydra", "omegaconf", "yaml", "tqdm", "matplotlib", "numpy", "scipy", "torchvision"),
    "speech": ("torchaudio", "soundfile"),
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` this Python cannot import."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, what: str, command: bool = False) -> None:
    """Fail in one line when ``what`` cannot run without ``extra``: as a command (``python -m``; also while
    ``-m`` loads the packages) a message and exit status 2, as an import an ImportError with the same line."""
    absent = missing(extra)
    if not absent:
        return
    line = (
        f"{what} needs dgc's `{extra}` extra ({', '.join(absent)} not installed for {sys.executable}): "
        f"pip install 'dgc[{extra}]' (in a checkout of dgc: make install)"
    )
    if command or sys.argv[:1] == ["-m"]:
        print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2)
    raise ImportError(line)
