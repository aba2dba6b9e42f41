"""The permissions of what cp-train and cp-generate write: those the process's umask gives a new file or folder.

``tempfile.mkstemp`` / ``mkdtemp`` (used to publish a file or folder atomically) create it private to the user
(0600 / 0700) whatever the umask; renamed into place it kept that mode (a metrics file of 0600 where ``open``
would have given 0644). Every file and folder we write is given the mode the umask gives, as ``open`` /
``mkdir`` do.
"""

from __future__ import annotations

import os


def current_umask() -> int:
    """The process's umask (read from ``/proc/self/status`` where Linux has it: setting it to read it would
    change it for a moment under other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode ``open`` gives a new file here (0666 less the umask)."""
    return 0o666 & ~current_umask()


def new_folder_mode() -> int:
    """The mode ``mkdir`` gives a new folder here (0777 less the umask)."""
    return 0o777 & ~current_umask()
