"""The program that runs inside the code sandbox (see tasks/sandbox.py). Standard library only.

`tasks.sandbox` copies this file into the sandbox and starts it with `python -I -S -B`; it is never
imported by the pipeline. Two phases:

- `setup CONFIG_JSON` (namespace isolation only, run as root inside fresh network / mount / pid /
  ipc / uts namespaces made by `unshare`): builds a minimal root (read-only binds of /usr and the
  interpreter's prefix, /dev/null and /dev/urandom, a size-limited tmpfs as the working
  directory), chroots into it, drops to an unprivileged uid with no_new_privs, closes every other
  descriptor and execs the `run` phase in a clean interpreter.
- `run JOB_PATH RESULT_FD GUARD`: applies the resource limits, optionally installs the audit hook
  (the Python-level guard), then runs each test in a fresh namespace dict and reports over
  RESULT_FD, one JSON line per event: {"event": "start", "index": i} before a test and
  {"event": "result", "index": i, "status", "output", "error", "stderr"} after it.

The job holds the program and the test INPUTS only; expected outputs stay with the parent, which
judges. Standard input / output / error of each test are files in the working directory dup'ed
onto fds 0 / 1 / 2, so `input()`, `sys.stdin.buffer`, `open(0)` and `os.write(1, ...)` all work.
"""

import builtins
import gc
import io
import json
import os
import resource
import signal
import sys
import traceback
import typing

SOLUTION = "<solution>"
TEST_FILES = ("<test>", "<test-setup>")
_MAX_ERROR_CHARS = 2000

# Mount flags (linux/mount.h) and prctl option used by the setup phase.
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384
_PR_SET_NO_NEW_PRIVS = 38


# -- setup phase (root, inside the new namespaces) ------------------------------------------------
def _mount(libc, source, target, fstype, flags, data):
    import ctypes

    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source!r} on {target!r}: {os.strerror(errno)}")


def setup(config):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    root, uid = config["root"], config["uid"]
    for name, target in config["symlinks"].items():
        os.symlink(target, os.path.join(root, name))
    for host in config["binds"]:
        inside = os.path.join(root, host.lstrip("/"))
        os.makedirs(inside, mode=0o755, exist_ok=True)
        _mount(libc, host, inside, None, _MS_BIND | _MS_REC, None)
        _mount(libc, None, inside, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, None)
    os.makedirs(os.path.join(root, "dev"), mode=0o755, exist_ok=True)
    for device in ("null", "zero", "urandom"):
        inside = os.path.join(root, "dev", device)
        open(inside, "a").close()
        _mount(libc, "/dev/" + device, inside, None, _MS_BIND, None)
    work = os.path.join(root, config["workdir"].lstrip("/"))
    os.makedirs(work, mode=0o755, exist_ok=True)
    options = f"size={config['tmpfs_bytes']},nr_inodes=4096,mode=0700,uid={uid},gid={uid}"
    _mount(libc, "tmpfs", work, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    os.chroot(root)
    os.chdir(config["workdir"])
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    keep = config["result_fd"]
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)
    python = config["python"]
    argv = [python, "-I", "-S", "-B", config["harness"], "run", config["job"], str(keep), config["guard"]]
    os.execve(python, argv, config["env"])


# -- run phase (unprivileged) ---------------------------------------------------------------------
def _set_limits(limits):
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Writing past RLIMIT_FSIZE then raises OSError (EFBIG) instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _under(path, roots):
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


_PROCESS_EVENTS = frozenset(
    {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
     "os.kill", "os.killpg", "signal.pthread_kill", "pty.spawn", "os.startfile"}
)
_WRITE_PATH_EVENTS = frozenset(
    {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
     "os.link", "os.symlink", "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copytree",
     "os.chflags", "os.setxattr", "os.removexattr"}
)
_READ_PATH_EVENTS = frozenset({"os.listdir", "os.scandir", "os.chdir", "glob.glob", "os.getxattr", "os.listxattr"})
_BLOCKED_MODULES = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def install_guard(*, workdir, read_roots):
    """Python-level guard: an audit hook (it cannot be removed) that refuses process creation,
    signals, sockets, ctypes, and file access outside the working directory (writes) or the
    working directory plus the standard library (reads)."""
    write_roots = (os.path.realpath(workdir),)
    read_roots = write_roots + tuple(os.path.realpath(p) for p in read_roots)

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

    def hook(event, args):
        if event in _PROCESS_EVENTS:
            deny(event, "")
        if event.startswith(("socket.", "ctypes.", "_ctypes.", "mmap.")):
            deny(event, "")
        if event == "import" and args[0].split(".")[0] in _BLOCKED_MODULES:
            deny("import", repr(args[0]))
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            check_path(event, path, write_roots if writing else read_roots)
        elif event in _WRITE_PATH_EVENTS and args:
            check_path(event, args[0], write_roots)
            if event in ("os.rename", "os.link", "os.symlink", "shutil.move", "shutil.copyfile", "shutil.copytree"):
                check_path(event, args[1], write_roots)
        elif event in _READ_PATH_EVENTS and args:
            check_path(event, args[0], read_roots)

    sys.addaudithook(hook)


def _describe(exc, source_lines):
    """'Type: message' plus the innermost line of the solution it came from."""
    try:  # str() of an exception runs the program's code; anything may happen there
        message = str(exc)
    except BaseException:  # noqa: BLE001 -- the sandbox boundary reports whatever the program raised
        message = "<unprintable message>"
    head = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == SOLUTION]
    if frames:
        f = frames[-1]
        line = source_lines[f.lineno - 1].strip() if 0 < (f.lineno or 0) <= len(source_lines) else ""
        head += f"\nLine {f.lineno} in {f.name}" + (f": {line}" if line else "")
    return head[:_MAX_ERROR_CHARS]


def _from_test_code(exc):
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename in TEST_FILES


def _redirect(fd, path, flags):
    new = os.open(path, flags, 0o600)
    if new != fd:  # the program may have closed `fd`, in which case open() reused its number
        os.dup2(new, fd)
        os.close(new)


def _text_stream(fd, mode):
    raw = io.FileIO(fd, mode, closefd=False)
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding="utf-8", errors="replace")


def _read_capped(path, limit):
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", "replace"), len(data) > limit


def run_one(job, index, code, source_lines):
    """Run test `index`; returns the result message (without the event key)."""
    kind, test_input = job["testtype"], job["inputs"][index]
    stdin_path, out_path, err_path = f".stdin-{index}", f".stdout-{index}", f".stderr-{index}"
    with open(stdin_path, "w", encoding="utf-8") as f:
        f.write(test_input if kind == "stdin" else "")
    _redirect(0, stdin_path, os.O_RDONLY)
    _redirect(1, out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    _redirect(2, err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdin = _text_stream(0, "r")
    sys.stdout = _text_stream(1, "w")
    sys.stderr = _text_stream(2, "w")
    namespace = {"__name__": "__main__" if kind == "stdin" else "solution", "__builtins__": builtins}
    if kind == "functional":  # LeetCode-style starter code uses List, Optional, ... without importing them
        namespace.update({name: getattr(typing, name) for name in typing.__all__})
    status, output, error = "ok", "", ""
    try:
        exec(code, namespace)
        if kind == "functional":
            target = namespace.get("Solution")
            if isinstance(target, type):
                target = getattr(target(), job["fn_name"], None)
            else:
                target = namespace.get(job["fn_name"])
            if not callable(target):
                raise NameError(f"the program defines no function or Solution method named {job['fn_name']!r}")
            args = [json.loads(line) for line in test_input.split("\n") if line.strip()]
            value = target(*args)
            output = json.dumps(value)
        elif kind == "assert":
            if job["setup"]:
                exec(compile(job["setup"], "<test-setup>", "exec"), namespace)
            exec(compile(test_input, "<test>", "exec"), namespace)
    except SystemExit:
        pass  # exit() after printing the answer is normal for stdin programs
    except AssertionError as exc:
        status = "failed" if kind == "assert" and _from_test_code(exc) else "error"
        error = _describe(exc, source_lines)
    except BaseException as exc:  # noqa: BLE001 -- the program's own errors are the test result
        status, error = "error", _describe(exc, source_lines)
    if os.getpid() != job["harness_pid"]:
        os._exit(0)  # a child the program forked: only the harness itself reports
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException as exc:  # noqa: BLE001 -- e.g. output past RLIMIT_FSIZE, or a closed stream
            if status == "ok":
                status, error = "error", f"could not write the output: {type(exc).__name__}: {exc}"
    sys.stdout = sys.stderr = sys.stdin = None
    limit = job["output_limit"]
    stdout, over = _read_capped(out_path, limit)
    stderr, _ = _read_capped(err_path, 4096)
    over = over or len(output) > limit  # a functional test's return value, as JSON text
    if over and status == "ok":
        status, error = "error", f"Output Limit Exceeded: the program wrote more than {limit} bytes"
    if kind != "functional":
        output, stdout = stdout, ""
    elif over:
        output = ""
    for path in (stdin_path, out_path, err_path):
        os.unlink(path)
    del namespace
    gc.collect()
    debug = (stdout + "\n" + stderr).strip() if stdout else stderr
    return {"index": index, "status": status, "output": output, "error": error, "stderr": debug}


def run(job_path, result_fd, guard):
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    _set_limits(job["rlimits"])
    job["harness_pid"] = os.getpid()
    report = os.fdopen(result_fd, "w", encoding="utf-8", buffering=1)

    def send(message):
        report.write(json.dumps(message) + "\n")
        report.flush()

    source_lines = job["code"].splitlines()
    try:
        code = compile(job["code"], SOLUTION, "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as exc:
        send({"event": "start", "index": 0})
        detail = _describe(exc, source_lines)
        if isinstance(exc, SyntaxError) and exc.lineno:
            detail = f"SyntaxError: {exc.msg}\nLine {exc.lineno}: {(exc.text or '').strip()}"
        send({"event": "result", "index": 0, "status": "error", "output": "", "error": detail, "stderr": ""})
        return
    if guard == "guard":
        stdlib = [p for p in sys.path if p]
        install_guard(workdir=os.getcwd(), read_roots=stdlib + ["/dev/null", "/dev/zero", "/dev/urandom"])
    for index in range(len(job["inputs"])):
        send({"event": "start", "index": index})
        result = run_one(job, index, code, source_lines)
        send({"event": "result", **result})


if __name__ == "__main__":
    if sys.argv[1] == "setup":
        setup(json.loads(sys.argv[2]))
    elif sys.argv[1] == "run":
        run(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown phase {sys.argv[1]!r}")
