"""A small tmpfs mounted for one test: a disk that fills up (mounting needs root; the test skips without)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(root: Path, size: str) -> Iterator[Path]:
    """`root` (made here) as a tmpfs of `size` (mount's spelling: "800k", "1m") until the block ends."""
    root.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (this process is not)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", str(root)], check=False)
