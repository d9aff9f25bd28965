"""Imported at start-up by every Python process of a restart test's torchrun job (tests/test_restarts.py
puts tests/hooks on its PYTHONPATH). In zero3's checkpoint writer process (`python -c`, started by a
rank whose restart_job.py set ZERO3_TEST_MID_SAVE_KILLS) it installs restart_job's `mid_save` kill for
async saves, which that process writes: once the listed step's files are written, before the tag is
published, it SIGKILLs its rank, and the kernel then kills it too (zero3.checkpoint.writer_process).
"""

import os
import sys

_STEPS = os.environ.get("ZERO3_TEST_MID_SAVE_KILLS")

if _STEPS and sys.argv[:1] == ["-c"]:
    import signal
    import time

    import zero3.checkpoint.state as checkpoint_state

    _kill_at = {f".global_step{step}.incomplete" for step in _STEPS.split(",")}
    _real_checksums = checkpoint_state.checksums

    def _checksums_or_kill_the_rank(files, checksum):  # type: ignore[no-untyped-def]
        if files and files[0].parent.name in _kill_at:
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(600)  # killed with its rank (PR_SET_PDEATHSIG)
        return _real_checksums(files, checksum)

    checkpoint_state.checksums = _checksums_or_kill_the_rank
