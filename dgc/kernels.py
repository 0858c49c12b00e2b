"""An optional native kernel for DGC's hot loop: accumulate, compare and collect in one memory pass.

DGC's compression step reads every gradient value a few times in plain PyTorch: the momentum
correction (``u = m u + g``; ``v += u``: two passes), ``|v|`` (a pass that writes a full-size
temporary), the comparison with the threshold (another pass writing a mask), the count and the
positions. :func:`acc_select` does all of it in one pass over ``g``, ``u`` and ``v``: it updates
``u`` and ``v`` in place, compares ``|v|`` with a threshold without materializing ``|v|``, counts the
entries that pass and writes their positions (ascending), so the compression step costs about what
the memory traffic of the momentum update costs.

The kernel is a few lines of C (:data:`SOURCE`), compiled with the system C compiler (``$CC``,
else ``cc``/``gcc``; ``-O3 -march=native -fopenmp``) the first time it is needed (about a second),
cached under ``$DGC_KERNEL_CACHE`` (default ``~/.cache/dgc``) by a hash of the source, the flags
and the CPU, and loaded with :mod:`ctypes`. It runs on ``torch.get_num_threads()`` OpenMP threads
(PyTorch's own ``libgomp`` when PyTorch is imported first, so one thread pool). Without a compiler,
when the build fails, or with ``DGC_KERNELS=0``, :func:`available` is False and the callers use
plain PyTorch operations with the same results.

Arithmetic is exactly PyTorch's: ``u = fma(u, m, g)`` is what ``torch.add(g, u, alpha=m)``
computes in its vectorized loop, Nesterov is ``u = (u + g) m; v = (v + u) + g``, and nothing
else is contracted (``-ffp-contract=off``).

Why not torch.compile: it fuses the loop but not the store of the positions (docs/design.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <omp.h>
#define BLOCK 64

/* mode 0: no update (compare and collect only); 1: v += g; 2: u = fma(u, m, g), v += u;
   3 (Nesterov): u = (u + g) * m, v = (v + u) + g.
   Then count |v| >= thr and write the positions that pass: thread t writes at most cap of them
   at pos + t * cap and its count (possibly > cap: overflow) at counts[t]. Threads own contiguous
   ascending ranges, so the positions are ascending in thread order. Per block of 64 entries the
   comparison makes a 64-bit mask (vectorized); only its set bits are visited. */
static inline void collect(const float* vb, int64_t base, int64_t len, float thr,
                           int64_t* out, int64_t cap, int64_t* c)
{
  uint64_t mask = 0;
  for (int64_t i = 0; i < len; i++) mask |= (uint64_t)(fabsf(vb[i]) >= thr) << i;
  while (mask) {
    int i = __builtin_ctzll(mask);
    if (*c < cap) out[*c] = base + i;
    (*c)++;
    mask &= mask - 1;
  }
}

void dgc_acc_select(const float* restrict g, float* restrict u, float* restrict v, int64_t n, int mode,
                    float m, float thr, int64_t* restrict pos, int64_t cap, int64_t* restrict counts,
                    int nthreads)
{
  #pragma omp parallel num_threads(nthreads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t chunk = (n + nt - 1) / nt;
    chunk = (chunk + BLOCK - 1) / BLOCK * BLOCK;
    int64_t lo = (int64_t)t * chunk;
    int64_t hi = lo + chunk < n ? lo + chunk : n;
    int64_t c = 0;
    int64_t* out = pos + (int64_t)t * cap;
    for (int64_t b = lo; b < hi; b += BLOCK) {
      int64_t len = hi - b < BLOCK ? hi - b : BLOCK;
      float* vb = v + b;
      if (len == BLOCK) {
        if (mode == 1) {
          const float* gb = g + b;
          for (int i = 0; i < BLOCK; i++) vb[i] += gb[i];
        } else if (mode == 2) {
          const float* gb = g + b; float* ub = u + b;
          for (int i = 0; i < BLOCK; i++) { float x = fmaf(ub[i], m, gb[i]); ub[i] = x; vb[i] += x; }
        } else if (mode == 3) {
          const float* gb = g + b; float* ub = u + b;
          for (int i = 0; i < BLOCK; i++) { float x = (ub[i] + gb[i]) * m; ub[i] = x; vb[i] = (vb[i] + x) + gb[i]; }
        }
      } else {
        for (int64_t i = 0; i < len; i++) {
          if (mode == 1) vb[i] += g[b + i];
          else if (mode == 2) { float x = fmaf(u[b + i], m, g[b + i]); u[b + i] = x; vb[i] += x; }
          else if (mode == 3) { float x = (u[b + i] + g[b + i]) * m; u[b + i] = x; vb[i] = (vb[i] + x) + g[b + i]; }
        }
      }
      collect(vb, b, len, thr, out, cap, &c);
    }
    counts[t] = c;
  }
}

/* |v| after the update of dgc_acc_select (same arithmetic) at positions start + i * stride,
   i < count, without updating anything: the sample DGC's threshold is estimated from. */
void dgc_sample(const float* restrict g, const float* restrict u, const float* restrict v, int64_t start,
                int64_t stride, int64_t count, int mode, float m, float* restrict out, int nthreads)
{
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < count; i++) {
    int64_t p = start + i * stride;
    float x = v[p];
    if (mode == 1) x += g[p];
    else if (mode == 2) x += fmaf(u[p], m, g[p]);
    else if (mode == 3) { float y = (u[p] + g[p]) * m; x = (x + y) + g[p]; }
    out[i] = fabsf(x);
  }
}
"""

#: modes of :func:`acc_select`
COMPARE, ADD, MOMENTUM, NESTEROV = 0, 1, 2, 3
#: tensors smaller than this use plain PyTorch (the call overhead is not worth it)
MIN_NUMEL = 1 << 11
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


_force_off = False


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this block :func:`usable` is False: callers use their PyTorch path (tests, comparisons)."""
    global _force_off
    before, _force_off = _force_off, True
    try:
        yield
    finally:
        _force_off = before


def _enabled_by_env() -> bool:
    return os.environ.get("DGC_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def cache_dir() -> Path:
    root = os.environ.get("DGC_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dgc"


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, version, _cpu_key()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"dgc_kernels-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        src = Path(tmp) / "dgc_kernels.c"
        src.write_text(SOURCE)
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(" ".join(proc.stderr.split())[:300] or f"{cc} exit status {proc.returncode}")
        os.replace(out, target)  # atomic: concurrent builders (ranks) all end with a complete file
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when unavailable."""
    global _lib, _tried, _error
    if _lib is not None or _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if not _enabled_by_env():
            _error = "disabled by DGC_KERNELS=0"
            return None
        cc = _compiler()
        if cc is None:
            _error = "no C compiler (cc/gcc) found"
            return None
        try:
            path = _build(cc)
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:  # a cached library that does not load (cut short, overwritten): built again, once
                path.unlink(missing_ok=True)
                lib = ctypes.CDLL(str(_build(cc)))
            fn = lib.dgc_acc_select
            fn.restype = None
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            fn.argtypes = [p, p, p, i64, ctypes.c_int, ctypes.c_float, ctypes.c_float, p, i64, p, ctypes.c_int]
            fn = lib.dgc_sample
            fn.restype = None
            fn.argtypes = [p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_float, p, ctypes.c_int]
            _lib = lib
        except Exception as exc:  # noqa: BLE001 - any build/load failure means "use PyTorch"
            _error = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"dgc: native selection kernel unavailable ({_error}); using PyTorch ops", stacklevel=2)
    return _lib


def available() -> bool:
    return library() is not None


def unavailable_reason() -> str | None:
    library()
    return _error


def usable(*tensors: torch.Tensor) -> bool:
    """True when the kernel can work on these tensors (contiguous fp32 on the CPU) and is available."""
    if _force_off:
        return False
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors) and available()
    )


class Buffers:
    """Per-thread position buffers, grown on demand and reused."""

    def __init__(self) -> None:
        self.pos = torch.empty(0, dtype=torch.int64, device="cpu")  # the C kernel runs on the CPU only
        self.counts = torch.empty(0, dtype=torch.int64, device="cpu")

    def get(self, threads: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos.numel() < threads * cap:
            self.pos = torch.empty(threads * cap, dtype=torch.int64, device="cpu")
        if self.counts.numel() < threads:
            self.counts = torch.zeros(threads, dtype=torch.int64, device="cpu")
        return self.pos, self.counts


_default_buffers = Buffers()


def acc_select(
    v: torch.Tensor,
    threshold: float,
    capacity: int,
    *,
    mode: int = COMPARE,
    g: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    momentum: float = 0.0,
    buffers: Buffers | None = None,
) -> tuple[int, torch.Tensor | None]:
    """One pass: update ``u``/``v`` by ``mode``, then count ``|v| >= threshold`` and collect positions.

    Returns ``(count, positions)``: ``positions`` are the ascending int64 positions that pass, or
    None when more than ``capacity`` passed in one thread's range (the count is still exact).
    Raises RuntimeError when the kernel is unavailable (check :func:`usable` first).
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"dgc native kernel unavailable: {_error}")
    n = v.numel()
    threads = max(1, min(torch.get_num_threads(), (n + 65535) // 65536))
    cap = max(1, int(capacity))
    pos, counts = (buffers or _default_buffers).get(threads, cap)
    if (mode != COMPARE and g is None) or (mode in (MOMENTUM, NESTEROV) and u is None):
        raise ValueError("acc_select: this mode needs g (and u)")
    counts[:threads].zero_()
    gp = g.data_ptr() if g is not None else None
    up = u.data_ptr() if u is not None else None
    lib.dgc_acc_select(
        gp, up, v.data_ptr(), n, mode, momentum, threshold, pos.data_ptr(), cap, counts.data_ptr(), threads
    )
    per = counts[:threads].tolist()
    total = sum(per)
    if max(per) > cap:
        return total, None
    parts = [pos[t * cap : t * cap + c] for t, c in enumerate(per) if c]
    if not parts:
        return 0, torch.empty(0, dtype=torch.int64, device="cpu")
    return total, torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def sample(
    v: torch.Tensor,
    where: slice,
    *,
    mode: int = COMPARE,
    g: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    momentum: float = 0.0,
) -> torch.Tensor:
    """``|v[where]|`` as :func:`acc_select` with ``mode`` is about to make it (nothing is updated)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"dgc native kernel unavailable: {_error}")
    if (mode != COMPARE and g is None) or (mode in (MOMENTUM, NESTEROV) and u is None):
        raise ValueError("sample: this mode needs g (and u)")
    start, stop, stride = where.indices(v.numel())
    count = max(0, (stop - start + stride - 1) // stride)
    out = torch.empty(count, dtype=torch.float32, device="cpu")
    threads = max(1, min(torch.get_num_threads(), (count + 16383) // 16384))
    lib.dgc_sample(
        g.data_ptr() if g is not None else None,
        u.data_ptr() if u is not None else None,
        v.data_ptr(),
        start,
        stride,
        count,
        mode,
        momentum,
        out.data_ptr(),
        threads,
    )
    return out
