"""`posttrain.utils.memory.release_freed_memory`: freed heap memory goes back to the kernel."""

import platform

import pytest

from posttrain.utils import memory

CHUNK = 64 * 1024          # under glibc's mmap threshold: served from the heap, not its own mapping
COUNT = 3000               # ~190 MiB


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim is glibc's")
def test_freed_heap_chunks_leave_the_resident_set_after_a_release():
    chunks = [bytearray(CHUNK) for _ in range(COUNT)]   # bytearray zero-fills: the pages are resident
    keep = chunks[-1]          # pins the heap's top, so free() alone cannot shrink it
    del chunks
    held = memory.rss_bytes()
    assert memory.release_freed_memory() is True
    released = held - memory.rss_bytes()
    # The freed chunks' pages, less allocator bookkeeping; without the release the set stays put.
    assert released > 0.8 * (COUNT - 1) * CHUNK, f"only {released / 2**20:.0f} MiB released"
    assert len(keep) == CHUNK
