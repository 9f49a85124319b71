"""The program that runs inside the code sandbox (see tasks/sandbox/program.py). Standard library only.

`tasks.sandbox.program` copies this file into the sandbox, with runner.py (the runner),
codec.py (plain values and the channel), guard.py (the audit hook) and extensions.py (the native modules the
program may use) beside it as sandbox_runner.py, sandbox_codec.py, sandbox_guard.py and sandbox_extensions.py,
and starts it with `python -I -S -B`; it is never imported by the pipeline. Three phases:

- `setup CONFIG_JSON` (namespace isolation only, run as root inside fresh network / mount / pid /
  ipc / uts namespaces made by `unshare`): joins the sandbox's memory cgroup, builds a minimal root
  (read-only binds of /usr and the interpreter's prefix, /dev/null and /dev/urandom, a size-limited
  tmpfs as the working directory), chroots into it, opens the job file (readable by root only),
  drops to an unprivileged uid with no_new_privs, closes every other descriptor and execs the
  `run` phase in a clean interpreter.
- `start JOB RESULT_FD GUARD UID LIMITS_JSON` (process isolation): sets no_new_privs and execs the
  `run` phase in a clean interpreter, so that ctypes (which prctl needs) is never loaded where
  the runner is forked from; the runner could reach it through sys.modules without an import.
- `run JOB RESULT_FD GUARD UID LIMITS_JSON`: the judge. It applies the resource limits and,
  before it reads the job, forks the runner, the only process that executes the program. The judge holds the
  report pipe to the parent; the runner holds none of it (every other descriptor is closed, and the
  judge is not dumpable, so the runner cannot reach its descriptors through /proc or ptrace). JOB
  is a descriptor number (namespace isolation) or a path readable by root only (process
  isolation as root: the runner then drops to UID; "-" keeps the uid).

The judge asks the runner, over a private pipe pair, to run one test at a time and reports to the
parent, one JSON line per event: {"event": "start", "index": i} before a test and {"event":
"result", "index": i, "status", "output", "error", "stderr"} after it. The runner's answers are
data only: standard output (stdin tests), the JSON text of a return value (functional tests, judged
by the parent), or plain values. An `assert` test's code runs in the judge, never in the runner's
interpreter: the names the program defines are proxies there, each call goes to the runner and its
result comes back as a plain value (sandbox_codec), so the program cannot exit the test
run with success, replace the test's functions or builtins, return an object that equals
everything, or read the test code (the runner was forked before the judge read the job).
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


def start(arguments):
    """Process isolation: no_new_privs (kept across exec and fork), then the `run` phase in a fresh
    interpreter."""
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), "run", *arguments])


if __name__ == "__main__" and sys.argv[1] == "start":  # before the imports of the other phases: it runs none
    start(sys.argv[2:])

import builtins  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the modules copied beside this file
from sandbox_codec import Channel, CodecError, decode, encode  # noqa: E402
from sandbox_extensions import ALLOWED, REFUSED  # noqa: E402
from sandbox_guard import install_guard  # noqa: E402
from sandbox_runner import Runner, describe  # noqa: E402

del sys.path[0]  # the sandbox's root folder: not a place the program may read from

TEST_FILES = ("<test>", "<test-setup>")

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
    ]
    os.execve(python, argv, config["env"])


def _pin_library(first):
    """Process isolation as root, before RLIMIT_NOFILE is lowered to `first`: open the standard
    library's folders (which the runner's uid may not be able to read) as descriptors numbered
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


def _start_runner(guard, uid, output_limit, library):
    """Fork the runner; returns (channel to it, its pid). Called before the job is read."""
    to_runner, from_runner = os.pipe(), os.pipe()
    pid = os.fork()
    if pid:
        os.close(to_runner[0])
        os.close(from_runner[1])
        for fd in library:
            os.close(fd)
        return Channel(from_runner[0], to_runner[1], max_bytes=4 * output_limit + (1 << 20)), pid
    start = 3
    for fd in sorted((to_runner[0], from_runner[1], *library)):
        os.closerange(start, fd)  # the report pipe, the job and the judge's ends: out of the program's reach
        start = fd + 1
    os.closerange(start, 65536)
    if uid is not None:
        _drop_to(uid, library)
    if guard == "guard":
        stdlib = [p for p in sys.path if p]
        install_guard(
            workdir=os.getcwd(),
            read_roots=stdlib + ["/dev/null", "/dev/zero", "/dev/urandom"],
            allowed=ALLOWED,
            refused=REFUSED,
        )
    channel = Channel(to_runner[0], from_runner[1], max_bytes=1 << 40)
    Runner(channel, output_limit).serve()
    os._exit(0)


def _set_limits(limits):
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Writing past RLIMIT_FSIZE then raises OSError (EFBIG) instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


# -- the judge ------------------------------------------------------------------------------------
class _ProgramFailed(Exception):
    """The program (in the runner) raised, exited or stopped answering during an assert test."""


class _Judge:
    def __init__(self, job, runner, runner_pid, report_fd):
        self.job, self.runner, self.runner_pid = job, runner, runner_pid
        self.report = os.fdopen(report_fd, "w", encoding="utf-8", buffering=1)
        self.failure, self.runner_status = "", None

    def send(self, message):
        self.report.write(json.dumps(message) + "\n")
        self.report.flush()

    def ask(self, request):
        """The runner's answer; _ProgramFailed when it died or answered garbage."""
        try:
            self.runner.send(request)
            answer = self.runner.receive()
        except ValueError:
            self._stop_runner()
            raise _ProgramFailed("the program corrupted the sandbox's report channel") from None
        except BrokenPipeError:
            answer = None  # the runner is gone
        if answer is None:
            status = self._stop_runner()
            if os.WIFSIGNALED(status):
                raise _ProgramFailed(f"the program crashed (killed by {signal.Signals(os.WTERMSIG(status)).name})")
            raise _ProgramFailed(f"the program ended the test run abruptly (exit status {os.WEXITSTATUS(status)})")
        return answer

    def _stop_runner(self):
        if self.runner_status is None:
            os.kill(self.runner_pid, signal.SIGKILL)  # unreaped, so the pid is still the runner's
            self.runner_status = os.waitpid(self.runner_pid, 0)[1]
        return self.runner_status

    def call(self, name, args, kwargs):
        try:
            request = {"op": "call", "name": name, "args": encode(args), "kwargs": encode(kwargs)}
        except CodecError as exc:
            raise _ProgramFailed(f"the test passes {name}() a value the sandbox cannot send: {exc}") from None
        answer = self.ask(request)
        if "error" in answer:
            self.failure = str(answer["error"])
            raise _ProgramFailed(self.failure)
        return decode(answer["value"])

    def proxy(self, name):
        def proxy(*args, **kwargs):
            return self.call(name, args, kwargs)

        proxy.__name__ = proxy.__qualname__ = name
        return proxy

    def run_assert(self, index):
        self.failure = ""
        status, error = "ok", ""
        try:
            loaded = self.ask({"op": "load", "index": index})
            if "error" in loaded:
                raise _ProgramFailed(str(loaded["error"]))
            namespace = {"__name__": "__test__", "__builtins__": builtins}
            for name, kind in loaded["names"].items():
                namespace[name] = self.proxy(name) if kind == "callable" else decode(kind[1])
            if self.job["setup"]:
                exec(compile(self.job["setup"], "<test-setup>", "exec"), namespace)
            exec(compile(self.job["inputs"][index], "<test>", "exec"), namespace)
        except _ProgramFailed as exc:
            if self.runner_status is not None:
                raise  # the runner is gone: run() reports this test and skips the rest
            status, error = "error", str(exc)
        except AssertionError as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            status = "failed" if frames and frames[-1].filename in TEST_FILES else "error"
            error = describe(exc, [])
        except BaseException as exc:  # noqa: BLE001 -- the test code failed on what the program returned
            status, error = "error", self.failure or describe(exc, [])
        finished = self.ask({"op": "finish"})
        if finished["error"] and status == "ok":
            status, error = "error", str(finished["error"])
        return {"status": status, "output": "", "error": error, "stderr": str(finished["stderr"])}

    def run_test(self, index):
        kind = self.job["testtype"]
        if kind == "assert":
            return self.run_assert(index)
        request = {"op": kind, "index": index, "input": self.job["inputs"][index], "fn_name": self.job["fn_name"]}
        answer = self.ask(request)
        return {key: str(answer[key]) for key in ("status", "output", "error", "stderr")}

    def run(self):
        n = len(self.job["inputs"])
        compiled = self.ask({"op": "program", "code": self.job["code"]})
        index = 0
        try:
            if "error" in compiled:
                self.send({"event": "start", "index": 0})
                self.send(
                    {
                        "event": "result",
                        "index": 0,
                        "status": "error",
                        "output": "",
                        "error": compiled["error"],
                        "stderr": "",
                    }
                )
                return
            for index in range(n):
                self.send({"event": "start", "index": index})
                self.send({"event": "result", "index": index, **self.run_test(index)})
        except _ProgramFailed as exc:  # the runner is gone: this test failed, the rest cannot run
            self.send(
                {"event": "result", "index": index, "status": "error", "output": "", "error": str(exc), "stderr": ""}
            )
            for rest in range(index + 1, n):
                self.send({"event": "start", "index": rest})
                self.send(
                    {
                        "event": "result",
                        "index": rest,
                        "status": "not_run",
                        "output": "",
                        "error": "not run: an earlier test stopped the run",
                        "stderr": "",
                    }
                )


def run(job_source, result_fd, guard, uid, limits):
    """The judge: limits, then the runner (forked before the job is read), then the tests."""
    if job_source.isdigit():
        job_file = os.fdopen(int(job_source), "rb", buffering=0)
    else:
        job_file = open(job_source, "rb", buffering=0)  # root-only: opened before the runner drops its uid
    if limits["cgroup_procs"]:  # process isolation as root: the judge joins the memory cgroup itself
        with open(limits["cgroup_procs"], "w") as f:
            f.write("0")
    library = [] if uid == "-" else _pin_library(limits["rlimits"]["RLIMIT_NOFILE"])
    _set_limits(limits["rlimits"])
    runner, pid = _start_runner(guard, None if uid == "-" else int(uid), limits["output_limit"], library)
    # No same-uid process may read this one's descriptors or memory. After the fork, so that the
    # runner holds no ctypes; it runs nothing of the program before the first request, sent below.
    _prctl(_PR_SET_DUMPABLE, 0)
    job = json.loads(job_file.read())
    job_file.close()
    _Judge(job, runner, pid, result_fd).run()


if __name__ == "__main__":
    if sys.argv[1] == "setup":
        setup(json.loads(sys.argv[2]))
    elif sys.argv[1] == "run":
        run(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], json.loads(sys.argv[6]))
    else:
        raise SystemExit(f"unknown phase {sys.argv[1]!r}")
