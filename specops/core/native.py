"""The lean forward's decoder layers in C++: native_decoder.cpp runs a pass's layers without the interpreter
between its ops and without the GIL, native_attention.cpp is its attention kernel, native_linear.cpp its
bf16 product kernel (specops.core.packed_linear packs the weights for it where this CPU has AVX-512 bf16) and
native_elementwise.cpp its bf16 row kernels (norms, rotary, SiLU, residual adds).

The Python loop (LlamaForward._layers_python) dispatches ~45 ops a layer, 1,350 for SmolLM2's 30 layers, at a
few microseconds each, and after each one takes the GIL back. The C++ loop runs the same products (through
packed_linear's choice of kernel for each weight, as the Python loop) and cache writes on the same tensors in
the same order, so those are the Python loop's bit for bit, and holds no GIL from a pass's first layer to its
last. In bf16 its norms, rotary, SiLU and adds are one row kernel each instead of ~35 ATen ops a layer: rotary
and the adds round as ATen's do, the norms' sums and SiLU's exp their own way (tests/core/test_native.py runs
the Python loop on those kernels where the two must match).

Its attention is a kernel of its own: each (sequence, kv head) reads its cache in place, only the slots its rows
see, in fp32, where ATen's attention stacks a batch's caches padded to the longest every layer. A row's result
depends only on its query and its visible slots, so batched passes are exact by construction (no padding limit,
no one-call-per-length fallback); it rounds otherwise than ATen's bf16 matmuls, so a process runs one runtime
or the other for every pass: the native one wherever the extension is built (all eager passes outside autograd),
the Python one where it is not (tests/core/test_native.py checks both against each other and the kernel against
a plain reference).

It is built once per machine with torch's C++ extension loader (a C++ compiler and ninja; about a minute on 2
cores), into TORCH_EXTENSIONS_DIR (the Makefile: .cache/torch_extensions), and rebuilt when a source changes.
Where it cannot be built, or with SPECOPS_NATIVE=0, LlamaForward runs its Python loop: slower, and rounding its
attention as ATen does. torch.compile traces the Python loop (an extension is opaque to it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("native_decoder.cpp", "native_attention.cpp",
                                                       "native_linear.cpp", "native_elementwise.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("native_attention.h", "native_linear.h",
                                                       "native_elementwise.h")]
ENV = "SPECOPS_NATIVE"  # "0": never build or use the extension


_FIRST_USE = threading.Lock()  # threads that first use it at once (a server's pass and packing threads) load it once


def extension() -> types.ModuleType | None:
    """The built extension, building it on first use; None with SPECOPS_NATIVE=0 or where it cannot be built
    (logged once: the Python loop then runs every pass)."""
    with _FIRST_USE:
        return _built()


@functools.cache
def _built() -> types.ModuleType | None:
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        # torch rebuilds when a source or a flag changes, not a header: the headers' hash is a flag.
        digest = hashlib.sha256(b"".join(path.read_bytes() for path in HEADERS)).hexdigest()[:16]
        # -fopenmp: ATen's parallel_for is a header template, serial unless the extension is built with OpenMP;
        # the libgomp.so.1 it links is the one torch has loaded already (the same soname), so one thread pool.
        # A name per source folder: this checkout, another one served beside it (load_test --checkout) and an
        # installed wheel (tests/test_wheel.py) each build their own. Under one name each rebuilt over the
        # other's whenever the other ran: a server started meanwhile waited a minute on the build, and a
        # kill mid-build left the build's lock behind.
        where = hashlib.sha256(str(Path(__file__).parent.resolve()).encode()).hexdigest()[:8]
        with _environment_ninja():
            return load(name=f"specops_decoder_{where}", sources=[str(path) for path in SOURCES],
                        extra_cflags=["-O3", "-fopenmp", f"-DSPECOPS_HEADER={digest}"], extra_ldflags=["-fopenmp"],
                        verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: the Python loop is the same function
        log.warning("specops: the native decoder could not be built (%s: %s); passes run the Python loop.",
                    type(error).__name__, error)
        return None


@contextlib.contextmanager
def _environment_ninja() -> Iterator[None]:
    """PATH with this Python environment's ninja first (the `ninja` package's), while torch builds: torch runs
    the `ninja` on PATH, and two ninjas hash a build's commands differently, so each rebuilt everything the
    other had built. A fresh clone's `make test` did (this venv's ninja 1.13 for processes with .venv/bin on
    PATH, the system's 1.11 for the others): a minute's rebuild each time one followed the other, which held a
    server past its readiness limit and, killed mid-build, left the build's lock behind. Without the package,
    PATH's ninja (one, for every process)."""
    try:
        import ninja
    except ImportError:
        yield
        return
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def set_threads(n: int) -> None:
    """This thread's intra-op threads, set so that they stay. ATen gives a thread the process-wide last count any
    thread set, once, at the thread's first parallel op, in libtorch and again in this extension (each inlines its
    own once-per-thread initialisation). So a thread that set its count before its first op took whatever another
    thread set meanwhile: a batched server's pass thread set 2, a generation thread set its own 1 per request, and
    the pass thread then ran every pass on one core until it ended (whole load-test phases at half the cores).
    Running both initialisations first, then setting, makes the count this thread's own."""
    torch.get_num_threads()  # libtorch's initialisation for this thread
    built = extension()
    if built is not None:
        built.init_threads()  # the extension's
    torch.set_num_threads(n)


def main() -> None:
    """`python -m specops.core.native`: build the extension now (make setup), failing loudly if it cannot."""
    if os.environ.get(ENV, "1") == "0":
        print(f"specops: {ENV}=0, the native decoder is not built; passes run the Python loop")
        return
    if extension() is None:
        raise SystemExit(f"The native decoder was not built (see the warning above, or unset {ENV}).")
    print(f"specops: native decoder ready ({', '.join(path.name for path in SOURCES)})")


if __name__ == "__main__":
    main()
