"""Host memory that does not grow from step to step: freed heap memory goes back to the kernel
(`posttrain.utils.memory.release_freed_memory`), and oneDNN keeps a bounded number of compiled
kernels (`posttrain.utils.onednn`)."""

import json
import os
import platform
import subprocess
import sys

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


ONEDNN_PROBE = "import json, os, posttrain; print(json.dumps(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY')))"


def onednn_capacity_after_import(**env: str):
    environ = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"} | env
    out = subprocess.run([sys.executable, "-c", ONEDNN_PROBE], env=environ, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_importing_posttrain_bounds_onednns_primitive_cache():
    assert onednn_capacity_after_import() == "64"


def test_the_users_own_primitive_cache_capacity_wins():
    assert onednn_capacity_after_import(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024") == "1024"
