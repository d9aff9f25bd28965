"""Imported at start-up by every Python process of a restart test's torchrun job (tests/test_restarts.py
puts tests/hooks on its PYTHONPATH), and by the checkpoint writers of tests/test_shared_state.py (on
their ranks' path). In zero3's checkpoint writer process (`python -c`, started by a rank whose restart_job.py set ZERO3_TEST_MID_SAVE_KILLS) it installs restart_job's `mid_save` kill for
async saves, which that process writes: once the listed step's files are written, before the tag is
published, it SIGKILLs its rank, and the kernel then kills it too (zero3.checkpoint.writer_process).
"""

import os
import sys

_STEPS = os.environ.get("ZERO3_TEST_MID_SAVE_KILLS")

if _STEPS and sys.argv[:1] == ["-c"]:
    import signal
    import time

    import zero3.checkpoint.tag_write as tag_write

    _kill_at = {f".global_step{step}.incomplete" for step in _STEPS.split(",")}
    _real_checksums = tag_write.checksums

    def _checksums_or_kill_the_rank(files, checksum):  # type: ignore[no-untyped-def]
        if files and files[0].parent.name in _kill_at:
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(600)  # killed with its rank (PR_SET_PDEATHSIG)
        return _real_checksums(files, checksum)

    tag_write.checksums = _checksums_or_kill_the_rank

# With ZERO3_TEST_SLOW_WRITES (seconds), zero3's checkpoint writer process waits that long before it writes
# each data file, so a test (tests/test_shared_state.py) changes the engine's state while a save that reads
# it in place has yet to read it.
_SLOW = os.environ.get("ZERO3_TEST_SLOW_WRITES")

if _SLOW and sys.argv[:1] == ["-c"]:
    import time

    from zero3.checkpoint import data_files

    _real_write_data = data_files.DataFileWriter.write_data

    def _slow_write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        time.sleep(float(_SLOW))
        return _real_write_data(self, plan, planner)

    data_files.DataFileWriter.write_data = _slow_write_data

# With ZERO3_TEST_HOLD_SAVES (a path), zero3's checkpoint writer process of rank 0 holds each tag, once
# every data file is written, until that file exists (20 s at most, then the save fails), so a test
# (tests/test_shared_state.py) trains on while a save it has read is not yet published.
_GATE = os.environ.get("ZERO3_TEST_HOLD_SAVES")

if _GATE and sys.argv[:1] == ["-c"]:
    import time

    import zero3.checkpoint.tag_write as tag_write

    _checksums_past_the_gate = tag_write.checksums

    def _checksums_once_the_gate_opens(files, checksum):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 20.0
        while not os.path.exists(_GATE):
            if time.monotonic() > deadline:
                raise OSError(f"the test's gate {_GATE} stayed shut")
            time.sleep(0.02)
        return _checksums_past_the_gate(files, checksum)

    tag_write.checksums = _checksums_once_the_gate_opens
