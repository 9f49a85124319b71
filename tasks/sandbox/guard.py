"""The Python-level guard of the code sandbox's runner (see tasks/sandbox/harness.py). Standard
library only: copied into the sandbox beside the harness and imported there as `sandbox_guard`."""

import os
import sys


def _under(path, roots):
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


_PROCESS_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "pty.spawn",
        "os.startfile",
    }
)
_WRITE_PATH_EVENTS = frozenset(
    {
        "os.remove",
        "os.rmdir",
        "os.rename",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
        "os.link",
        "os.symlink",
        "shutil.rmtree",
        "shutil.move",
        "shutil.copyfile",
        "shutil.copytree",
        "os.chflags",
        "os.setxattr",
        "os.removexattr",
    }
)
_READ_PATH_EVENTS = frozenset({"os.listdir", "os.scandir", "os.chdir", "glob.glob", "os.getxattr", "os.listxattr"})
_BLOCKED_MODULES = frozenset(
    {"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi", "_posixshmem", "_multiprocessing"}
)
# functions that create files or signal processes without raising an audit event
_REMOVED_FUNCTIONS = (
    "mkfifo",
    "mknod",
    "pidfd_open",
    "setpriority",
    "fchdir",
    "fchmod",
    "fchown",
    "memfd_create",
    "setsid",
    "setpgid",
    "setpgrp",
)  # the last three: leaving the sandbox's process group
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def install_guard(*, workdir, read_roots):
    """Python-level guard: an audit hook (it cannot be removed) that refuses process creation,
    signals, sockets, ctypes, limits set on other processes, and file access outside the working
    directory (writes) or the working directory plus the standard library (reads); directories
    outside the working directory cannot be opened at all, so no `dir_fd` can point elsewhere.
    The os functions that act without an audit event (mkfifo, mknod, ...) are removed."""
    write_roots = (os.path.realpath(workdir),)
    read_roots = write_roots + tuple(os.path.realpath(p) for p in read_roots)
    for module in (os, sys.modules["posix"]):
        for name in _REMOVED_FUNCTIONS:
            module.__dict__.pop(name, None)

    def deny(event, detail):
        raise PermissionError(f"sandbox: {event}{' ' + detail if detail else ''} is not allowed")

    def check_path(event, path, roots):
        if isinstance(path, int):
            return
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if path is None:
            path = "."
        if not isinstance(path, str):
            path = os.fspath(path)
        real = os.path.realpath(path)
        if not _under(real, roots):
            deny(event, repr(path))
        return real

    def hook(event, args):
        if event in _PROCESS_EVENTS:
            deny(event, "")
        if event == "resource.prlimit" and args[0] not in (0, os.getpid()):
            deny(event, f"on process {args[0]}")
        if event.startswith(("socket.", "ctypes.", "_ctypes.", "mmap.")):
            deny(event, "")
        if event == "import" and args[0].split(".")[0] in _BLOCKED_MODULES:
            deny("import", repr(args[0]))
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            real = check_path(event, path, write_roots if writing else read_roots)
            if real is not None and not _under(real, write_roots) and os.path.isdir(real):
                deny(event, f"{path!r} (a directory outside the working directory)")
        elif event in _WRITE_PATH_EVENTS and args:
            check_path(event, args[0], write_roots)
            if event in ("os.rename", "os.link", "os.symlink", "shutil.move", "shutil.copyfile", "shutil.copytree"):
                check_path(event, args[1], write_roots)
        elif event in _READ_PATH_EVENTS and args:
            check_path(event, args[0], read_roots)

    sys.addaudithook(hook)
