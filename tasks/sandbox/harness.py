"""The program that runs inside the code sandbox (see tasks/sandbox/program.py). Standard library only.

`tasks.sandbox.isolation` copies this file into the sandbox, with runner.py (the zygote and the call
processes), judge.py (the judge of each test), codec.py (plain values and the channel), guard.py (the
audit hook) and extensions.py (the native modules the program may use) beside it as
sandbox_runner.py, sandbox_judge.py, sandbox_codec.py, sandbox_guard.py and sandbox_extensions.py,
and starts it with `python -I -S -B`; it is never imported by the pipeline. Three phases:

- `setup CONFIG_JSON` (namespace isolation only, run as root inside fresh network / mount / pid /
  ipc / uts namespaces made by `unshare`): joins the sandbox's memory cgroup, builds a minimal root
  (read-only binds of /usr and the interpreter's prefix, /dev/null and /dev/urandom, a size-limited
  tmpfs as the working directory), chroots into it, opens the job file (readable by root only),
  drops to an unprivileged uid with no_new_privs, closes every other descriptor and execs the
  `run` phase in a clean interpreter.
- `start JOB RESULT_FD GUARD UID LIMITS_JSON` (process isolation): sets no_new_privs, makes the
  control socket pair and execs the `run` phase in a clean interpreter, so that neither ctypes
  (which prctl needs) nor the socket module is ever loaded where the zygote is forked from; a call
  process could reach them through sys.modules (or their classes) without an import.
- `run JOB RESULT_FD GUARD UID LIMITS_JSON CONTROL`: the judge. It applies the resource limits, reads
  the program (the head of the job) and, before it reads the tests, forks the zygote
  (sandbox_runner), which never runs the program itself but forks one fresh call process per
  request, the only processes that execute it; only then does the judge load ctypes and the socket
  module. The judge holds the report pipe to the parent; the zygote and the call processes hold none
  of it (every other descriptor is closed, and the judge is not dumpable, so no call process reaches
  its descriptors through /proc or ptrace). JOB is a descriptor number (namespace isolation) or a
  path readable by root only (process isolation as root: the zygote then drops to UID; "-" keeps the
  uid); CONTROL is the two descriptors of the control socket pair, "JUDGE,ZYGOTE".

The judge runs one test at a time and reports to the parent, one JSON line per event: {"event":
"start", "index": i} before a test and {"event": "result", "index": i, "status", "output", "error",
"stderr"} after it. A stdin or functional test is one request to a fresh call process, answered
with data only: standard output, or the JSON text of a return value (judged by the parent). An
`assert` test's code runs in the judge, never in a process that runs the program, in a namespace
the program cannot shape: the judge's own builtins, the suite's setup (which carries the reference
definitions of the prompt's helpers) and, from the program, only the suite's entry points. Those are
proxies: each call goes to a fresh call process (the program's module code, then the one call) and
its result comes back as a plain value (sandbox_codec) for the test to compare. So the program
cannot exit the test run with success, replace a builtin or helper the test uses, return an object
that equals everything, read the test code (the zygote was forked before the judge read it), or
keep anything from one call to the next (the arguments of a call, which may be a test's expected
value, die with its process).
"""

import os
import sys

_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 4, 38  # prctl options


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _prctl(option, value):
    ctypes, libc = _libc()
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


def _control_pair():
    """The judge's and the zygote's ends of a new socket pair, as "JUDGE,ZYGOTE" (inheritable
    descriptors). Made here, before the `run` phase's exec, so that the judge has not loaded the
    socket module when it forks the zygote."""
    import _socket

    numbers = []
    for end in _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM):
        number = end.detach()
        os.set_inheritable(number, True)
        numbers.append(str(number))
    return ",".join(numbers)


def start(arguments):
    """Process isolation: no_new_privs (kept across exec and fork), then the `run` phase in a fresh
    interpreter."""
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    harness = os.path.abspath(__file__)
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", harness, "run", *arguments, _control_pair()])


if __name__ == "__main__" and sys.argv[1] == "start":  # before the imports of the other phases: it runs none
    start(sys.argv[2:])

import json  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the modules copied beside this file
from sandbox_judge import Judge, SandboxGone  # noqa: E402
from sandbox_runner import Zygote  # noqa: E402

del sys.path[0]  # the sandbox's root folder: not a place the program may read from


# Mount flags (linux/mount.h).
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384


# -- setup phase (root, inside the new namespaces) ------------------------------------------------
def _mount(libc, source, target, fstype, flags, data):
    import ctypes

    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source!r} on {target!r}: {os.strerror(errno)}")


def setup(config):
    _, libc = _libc()
    if config["cgroup_procs"]:
        with open(config["cgroup_procs"], "w") as f:
            f.write("0")  # this process and everything it starts count against one memory limit
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
    job_fd = os.open(config["job"], os.O_RDONLY)  # root-only file: the open descriptor is the only way in
    os.set_inheritable(job_fd, True)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    keep = sorted((config["result_fd"], job_fd))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 65536)
    python = config["python"]
    argv = [
        python,
        "-I",
        "-S",
        "-B",
        config["harness"],
        "run",
        str(job_fd),
        str(config["result_fd"]),
        config["guard"],
        "-",
        config["limits"],
        _control_pair(),
    ]
    os.execve(python, argv, config["env"])


def _pin_library(first):
    """Process isolation as root, before RLIMIT_NOFILE is lowered to `first`: open the standard
    library's folders (which the zygote's uid may not be able to read) as descriptors numbered
    from `first`. Past the limit, the program can close them but never put another folder in
    their place (dup2 and open only reach numbers below it), so a path through /proc/self/fd/N
    keeps naming the standard library, which the guard's checks of extension files rely on."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # room for the numbers; lowered right after
    numbers = []
    for number, folder in enumerate((p for p in sys.path if p and os.path.isdir(p)), start=first):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        os.dup2(fd, number, inheritable=False)
        os.close(fd)
        numbers.append(number)
    return numbers


def _drop_to(uid, library):
    """Process isolation as root: import the standard library through the descriptors `library`
    (see _pin_library), then become `uid` (no_new_privs was set by the `start` phase)."""
    sys.path[:] = [f"/proc/self/fd/{number}" for number in library]
    sys.path_importer_cache.clear()
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _start_zygote(program, guard, uid, output_limit, sweep, library, control):
    """Fork the zygote; returns its pid. Called before the tests are read, and before this process
    loads anything a call process must not find in its memory (ctypes, the socket module)."""
    pid = os.fork()
    if pid:
        os.close(control)
        for fd in library:
            os.close(fd)
        return pid
    start = 3
    for fd in sorted((control, *library)):
        os.closerange(start, fd)  # the report pipe, the job and the judge's end: out of the program's reach
        start = fd + 1
    os.closerange(start, 65536)
    if uid is not None:
        _drop_to(uid, library)
    Zygote(control, program, guard=guard == "guard", output_limit=output_limit, sweep=sweep).serve()
    os._exit(0)


def _set_limits(limits):
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Writing past RLIMIT_FSIZE then raises OSError (EFBIG) instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


# -- the judge ------------------------------------------------------------------------------------
def _read_exactly(fd, size):
    chunks = []
    while size > 0:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError("the job file ended early")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read_rest(fd):
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def run(job_source, result_fd, guard, uid, limits, control):
    """The judge: limits, then the zygote (forked when only the program has been read), then the tests.

    The job is `<length>\n`, that many bytes of {"code"}, then the tests' JSON (tasks/sandbox/program.py)."""
    fd = int(job_source) if job_source.isdigit() else os.open(job_source, os.O_RDONLY)  # root-only file
    if limits["cgroup_procs"]:  # process isolation as root: the judge joins the memory cgroup itself
        with open(limits["cgroup_procs"], "w") as f:
            f.write("0")
    library = [] if uid == "-" else _pin_library(limits["rlimits"]["RLIMIT_NOFILE"])
    _set_limits(limits["rlimits"])
    header = b""
    while not header.endswith(b"\n") and len(header) < 24:
        header += _read_exactly(fd, 1)
    program = json.loads(_read_exactly(fd, int(header)))["code"]
    output_limit = limits["output_limit"]
    sweep = os.getpid() == 1  # the init of the sandbox's own pid namespace
    judge_end, zygote_end = (int(number) for number in control.split(","))
    pid = _start_zygote(program, guard, None if uid == "-" else int(uid), output_limit, sweep, library, zygote_end)
    # No same-uid process may read this one's descriptors or memory. After the fork, so that the
    # zygote holds no ctypes; it runs nothing of the program before the first request, sent below.
    _prctl(_PR_SET_DUMPABLE, 0)
    import socket  # likewise only after the fork

    zygote = socket.socket(fileno=judge_end)
    job = json.loads(_read_rest(fd))
    os.close(fd)
    judge = Judge(job, zygote, pid, result_fd, output_limit)
    try:
        compiled = judge.zygote_says()
    except SandboxGone as exc:
        compiled = {"error": str(exc)}
    judge.run(str(compiled.get("error") or ""))


if __name__ == "__main__":
    if sys.argv[1] == "setup":
        setup(json.loads(sys.argv[2]))
    elif sys.argv[1] == "run":
        run(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], json.loads(sys.argv[6]), sys.argv[7])
    else:
        raise SystemExit(f"unknown phase {sys.argv[1]!r}")
