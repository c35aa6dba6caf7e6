"""A fault injected into a real loopd: an `LD_PRELOAD` library whose `write` fails with the
errno a marker in the data names (`@@EIO@@`, `@@EROFS@@`, `@@ENOSPC@@`), for writes to
session logs only (`*.jsonl`, and a new one's `.jsonl.partial`), before any byte is written.
A chosen record then fails the way a dying disk, a folder turned read-only or a full disk
fails it, in the process that wrote it, while every other write (other sessions, the
socket, loopd's own log) goes through."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["MARKS", "build"]

MARKS = ("EIO", "EROFS", "ENOSPC")

_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int is_log(int fd) {
    char link[64], target[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0) return 0;
    target[n] = 0;
    return strstr(target, ".jsonl") != NULL;
}

ssize_t write(int fd, const void *data, size_t size) {
    static ssize_t (*real)(int, const void *, size_t);
    static const char *marks[] = {"@@EIO@@", "@@EROFS@@", "@@ENOSPC@@"};
    static const int errors[] = {EIO, EROFS, ENOSPC};
    if (!real) real = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    for (int i = 0; i < 3; i++) {
        if (memmem(data, size, marks[i], strlen(marks[i])) && is_log(fd)) {
            errno = errors[i];
            return -1;
        }
    }
    return real(fd, data, size);
}
"""


def build(folder: Path) -> Path:
    """The library, compiled into `folder` (the C compiler llama-server's build uses)."""
    source, library = folder / "failing_writes.c", folder / "failing_writes.so"
    source.write_text(_SOURCE)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source), "-ldl"], check=True
    )
    return library
