"""The worker freezes the heap after each warm-up (specops.server.worker.freeze_heap): the collector no longer
walks what is frozen, and a model a hot swap drops must still be freed, by reference counting alone."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import torch

from specops.core.target import target_from_model
from specops.core.types import SamplingParams
from specops.server.metrics import ServerMetrics
from specops.server.worker import Event, Finished, GenerationWorker, Job
from tests.conftest import tiny_llama, tiny_tokenizer
from tests.server.test_batching import bf16_model


class _Cycle:
    me: _Cycle


def generate(worker: GenerationWorker, index: int) -> None:
    done, box = threading.Event(), []

    def emit(event: Event) -> None:
        if not hasattr(event, "text"):  # Finished or Failed
            box.append(event)
            done.set()

    worker.submit(Job(f"gc-{index}", "chat", [5, 6, 7, 8], 8, SamplingParams(), 0, [], None, emit))
    assert done.wait(60) and isinstance(box[0], Finished)


def test_a_swapped_out_model_is_freed_with_the_heap_frozen():
    """A batched server (bf16, a draft LM drafting beside the target) serves, swaps in another model and
    serves again; the old model's generator and draft model are then freed with the collector off, so no
    reference cycle holds them (frozen, a cycle would stay for good: the control shows it does)."""
    target = target_from_model(tiny_llama(0, dtype=torch.bfloat16, hidden=96), tiny_tokenizer(), "tiny-bf16")
    old = bf16_model(target, "draft-lm")
    worker = GenerationWorker(old, queue_size=4, metrics=ServerMetrics(), feedback=None, slots=2)
    worker.start()
    try:
        assert worker.ready.wait(120) and worker.batched
        generate(worker, 0)
        worker.swap(bf16_model(target, "draft-lm"))
        generate(worker, 1)  # a slot that served the old model has moved on to the new one
        generator, draft = weakref.ref(old.generator), weakref.ref(old.generator.drafter.model)
        del old
        gc.disable()
        try:
            deadline = time.monotonic() + 30
            while (generator() is not None or draft() is not None) and time.monotonic() < deadline:
                generate(worker, 2)  # every slot picks a job up, and lets go of the old serving
            assert generator() is None and draft() is None
        finally:
            gc.enable()
        control = _Cycle()
        control.me = control
        cycle = weakref.ref(control)
        gc.freeze()
        del control
        gc.collect()
        assert cycle() is not None  # frozen cycles are not collected: freeing must not rely on the collector
    finally:
        worker.stop()  # unfreezes
    gc.collect()
    assert cycle() is None
