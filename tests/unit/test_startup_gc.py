"""Full collections wait while a process imports (`posttrain.utils.startup_gc`): importing torch
after posttrain runs none, and `imports_done` gives the process CPython's collector back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def run_python(code: str) -> dict:
    """`code` in a fresh interpreter (the collector's state is per process); it prints one JSON line."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_torch_after_posttrain_runs_no_full_collection_until_imports_are_done():
    result = run_python("""
        import gc, json
        full = []
        gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(1))
        default = gc.get_threshold()
        import posttrain
        from posttrain.utils import startup_gc
        import torch  # two full collections on CPython 3.11 without the deferral
        during = startup_gc.state()
        startup_gc.imports_done(freeze=False)
        after = startup_gc.state()
        startup_gc.imports_done(freeze=True)  # only the first call counts
        print(json.dumps({"default": default, "full": len(full), "during": during, "after": after,
                          "frozen_later": gc.get_freeze_count()}))
    """)
    assert result["full"] == 0
    assert result["during"]["deferring"] and result["during"]["thresholds"][2] == 1000
    assert result["during"]["thresholds"][:2] == result["default"][:2]  # young generations as always
    assert not result["after"]["deferring"] and result["after"]["thresholds"] == result["default"]
    assert result["after"]["frozen"] == 0 and result["frozen_later"] == 0


def test_a_process_of_posttrains_own_freezes_what_it_imported():
    result = run_python("""
        import gc, json
        import posttrain
        from posttrain.utils import startup_gc
        startup_gc.imports_done(freeze=True)
        print(json.dumps(startup_gc.state()))
    """)
    assert not result["deferring"] and result["frozen"] > 1000


def test_a_program_that_turned_the_collector_off_keeps_it_off():
    result = run_python("""
        import gc, json
        gc.disable()
        import posttrain
        from posttrain.utils import startup_gc
        off = startup_gc.state()
        print(json.dumps({"off": off, "enabled": gc.isenabled()}))
    """)
    assert not result["off"]["deferring"] and not result["enabled"]
