"""A required file on a mount that answers EIO a few times, through the real runner: the open
calls of the runner process fail for real (an LD_PRELOAD shim built with gcc makes libc's
open() return EIO for one path, N times), and the runner waits them out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static int remaining = -1;

static int inject(const char *path) {
    const char *target = getenv("FLAKY_PATH");
    if (target == NULL || path == NULL || strcmp(path, target) != 0) return 0;
    if (remaining < 0) remaining = atoi(getenv("FLAKY_EIO_COUNT") ? getenv("FLAKY_EIO_COUNT") : "0");
    if (remaining == 0) return 0;
    remaining--;
    errno = EIO;
    return 1;
}

#define WRAP(name, ...)                                                        \
    static int (*real)(__VA_ARGS__);                                           \
    if (!real) real = dlsym(RTLD_NEXT, name);

int open(const char *path, int flags, ...) {
    mode_t mode = 0;
    if (flags & O_CREAT) { va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); }
    if (inject(path)) return -1;
    WRAP("open", const char *, int, ...)
    return real(path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    mode_t mode = 0;
    if (flags & O_CREAT) { va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); }
    if (inject(path)) return -1;
    WRAP("open64", const char *, int, ...)
    return real(path, flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...) {
    mode_t mode = 0;
    if (flags & O_CREAT) { va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); }
    if (inject(path)) return -1;
    WRAP("openat", int, const char *, int, ...)
    return real(dirfd, path, flags, mode);
}
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    work = tmp_path_factory.mktemp("shim")
    (work / "shim.c").write_text(SHIM)
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O1",
            "-o",
            str(work / "eio.so"),
            str(work / "shim.c"),
            "-ldl",
        ],
        check=True,
        capture_output=True,
    )
    return work / "eio.so"


def test_a_required_file_that_answers_eio_a_few_times_is_waited_for(kit, tmp_path, marker, shim):
    data = tmp_path / "data.bin"
    data.write_bytes(b"payload")
    script = kit.workload(
        tmp_path, f"import os\nopen({str(marker)!r}, 'w').write(os.environ.get('LD_PRELOAD', ''))\n"
    )
    profile = kit.basic_profile(tmp_path, tail='requirements:\n  files: ["{cwd}/data.bin"]\n')
    prepared = kit.staged(tmp_path, profile, script)
    env = dict(os.environ, LD_PRELOAD=str(shim), FLAKY_PATH=str(data), FLAKY_EIO_COUNT="4")

    impatient = kit.run_runner(prepared, "--file-wait-seconds", "0", env=env)
    assert impatient.returncode == 78
    line = kit.failure(impatient.stderr)
    assert line["check"] == "requirements.files"
    assert str(data) in line["error"] and "Input/output error" in line["error"]
    assert not marker.exists()

    done = kit.run_runner(prepared, "--file-wait-seconds", "60", env=env)
    assert done.returncode == 0, done.stderr
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["observed"][f"file:{data}"] == "available"
    assert marker.read_text() == ""  # and LD_PRELOAD never reached the workload
