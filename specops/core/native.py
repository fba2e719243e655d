"""The lean forward's decoder layers in C++ (native_decoder.cpp): the same ATen ops as LlamaForward's Python loop, run
without the interpreter between them and without the GIL.

The Python loop dispatches ~45 ops a layer, 1,350 for SmolLM2's 30 layers, at a few microseconds each, and after
each one takes the GIL back; on a batched server the generation threads hold it much of the time (verifying,
streaming, drafting in Python), so the pass thread waited for it between ops. The C++ loop calls the same ATen
functions on the same tensors in the same order, so its outputs and cache writes are bitwise the Python loop's
(tests/core/test_native.py), and holds no GIL from a pass's first layer to its last.

It is built once per machine with torch's C++ extension loader (a C++ compiler and ninja; about 40 s on 2
cores), into TORCH_EXTENSIONS_DIR (the Makefile: .cache/torch_extensions), and rebuilt when native_decoder.cpp
changes. Where it cannot be built, or with SPECOPS_NATIVE=0, LlamaForward runs its Python loop: the same
values, slower. torch.compile traces the Python loop (an extension is opaque to it).
"""

from __future__ import annotations

import functools
import logging
import os
import types
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_decoder.cpp")
ENV = "SPECOPS_NATIVE"  # "0": never build or use the extension


@functools.cache
def extension() -> types.ModuleType | None:
    """The built extension, building it on first use; None with SPECOPS_NATIVE=0 or where it cannot be built
    (logged once: the Python loop then runs every pass)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="specops_decoder", sources=[str(SOURCE)], extra_cflags=["-O2"], verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: the Python loop is the same function
        log.warning("specops: the native decoder could not be built (%s: %s); passes run the Python loop.",
                    type(error).__name__, error)
        return None


def main() -> None:
    """`python -m specops.core.native`: build the extension now (make setup), failing loudly if it cannot."""
    if os.environ.get(ENV, "1") == "0":
        print(f"specops: {ENV}=0, the native decoder is not built; passes run the Python loop")
        return
    if extension() is None:
        raise SystemExit(f"The native decoder was not built (see the warning above, or unset {ENV}).")
    print(f"specops: native decoder ready ({SOURCE.name})")


if __name__ == "__main__":
    main()
