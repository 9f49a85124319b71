"""The program that runs inside the code sandbox (see tasks/sandbox.py). Standard library only.

`tasks.sandbox` copies this file into the sandbox and starts it with `python -I -S -B`; it is never
imported by the pipeline. Two phases:

- `setup CONFIG_JSON` (namespace isolation only, run as root inside fresh network / mount / pid /
  ipc / uts namespaces made by `unshare`): joins the sandbox's memory cgroup, builds a minimal root
  (read-only binds of /usr and the interpreter's prefix, /dev/null and /dev/urandom, a size-limited
  tmpfs as the working directory), chroots into it, opens the job file (readable by root only),
  drops to an unprivileged uid with no_new_privs, closes every other descriptor and execs the
  `run` phase in a clean interpreter.
- `run JOB RESULT_FD GUARD UID LIMITS_JSON`: the judge. It applies the resource limits and, before it reads
  the job, forks the runner, the only process that executes the program. The judge holds the
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
result comes back as a plain value (`encode` / `decode` below), so the program cannot exit the test
run with success, replace the test's functions or builtins, return an object that equals
everything, or read the test code (the runner was forked before the judge read the job).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the two modules copied beside this file
from sandbox_codec import CodecError, decode, encode, to_json  # noqa: E402
from sandbox_guard import install_guard  # noqa: E402

del sys.path[0]  # the sandbox's root folder: not a place the program may read from

SOLUTION = "<solution>"
TEST_FILES = ("<test>", "<test-setup>")
_MAX_ERROR_CHARS = 2000
_MAX_STDERR = 4096
_OUTPUT_LIMIT = "Output Limit Exceeded"

# Mount flags (linux/mount.h) and prctl options.
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384
_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 4, 38


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _prctl(option, value):
    ctypes, libc = _libc()
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


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
    argv = [python, "-I", "-S", "-B", config["harness"], "run", str(job_fd), str(config["result_fd"]),
            config["guard"], "-", config["limits"]]
    os.execve(python, argv, config["env"])


# -- helpers --------------------------------------------------------------------------------------
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


def _exit_text(exc):
    return f"the program called exit() during a test (SystemExit: {exc.code!r}); a test only passes by finishing"


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


class _Channel:
    """JSON lines over a pair of pipes, read linearly, each message at most `max_bytes`."""

    def __init__(self, read_fd, write_fd, max_bytes):
        self.read_fd, self.write_fd, self.max_bytes = read_fd, write_fd, max_bytes
        self.buffer, self.scanned = bytearray(), 0

    def send(self, message):
        data = (json.dumps(message) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.write_fd, view):]

    def receive(self):
        """The next message, or None at end of file; ValueError for an oversized or unreadable one."""
        while True:
            end = self.buffer.find(b"\n", self.scanned)
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 1]
                self.scanned = 0
                message = json.loads(line)
                if not isinstance(message, dict):
                    raise ValueError("not a JSON object")
                return message
            self.scanned = len(self.buffer)
            if len(self.buffer) > self.max_bytes:
                raise ValueError(f"a message over {self.max_bytes} bytes")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                return None
            self.buffer += chunk


# -- the runner (forked by the judge before the job is read; the only process running the program) --
class _Runner:
    def __init__(self, channel, output_limit):
        self.channel, self.output_limit = channel, output_limit
        self.code, self.source_lines, self.namespace, self.index = None, [], {}, -1

    def serve(self):
        while (request := self.channel.receive()) is not None:
            self.channel.send(getattr(self, "op_" + request["op"])(request))

    def op_program(self, request):
        self.source_lines = request["code"].splitlines()
        try:
            self.code = compile(request["code"], SOLUTION, "exec")
        except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as exc:
            detail = _describe(exc, self.source_lines)
            if isinstance(exc, SyntaxError) and exc.lineno:
                detail = f"SyntaxError: {exc.msg}\nLine {exc.lineno}: {(exc.text or '').strip()}"
            return {"error": detail}
        return {}

    def _begin(self, index, stdin_text):
        self.index = index
        with open(f".stdin-{index}", "w", encoding="utf-8") as f:
            f.write(stdin_text)
        _redirect(0, f".stdin-{index}", os.O_RDONLY)
        _redirect(1, f".stdout-{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        _redirect(2, f".stderr-{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        sys.stdin, sys.stdout, sys.stderr = _text_stream(0, "r"), _text_stream(1, "w"), _text_stream(2, "w")

    def _end(self):
        """(stdout, stderr, error): the captured streams; error when they could not be written."""
        error = ""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException as exc:  # noqa: BLE001 -- e.g. output past RLIMIT_FSIZE, or a closed stream
                error = error or f"could not write the output: {type(exc).__name__}: {exc}"
        sys.stdout = sys.stderr = sys.stdin = None
        stdout, over = _read_capped(f".stdout-{self.index}", self.output_limit)
        stderr, _ = _read_capped(f".stderr-{self.index}", _MAX_STDERR)
        if over or os.path.getsize(f".stdout-{self.index}") >= self.output_limit:
            error = f"{_OUTPUT_LIMIT}: the program wrote more than {self.output_limit} bytes"
        for name in ("stdin", "stdout", "stderr"):
            os.unlink(f".{name}-{self.index}")
        self.namespace = {}
        gc.collect()
        return stdout, stderr, error

    @staticmethod
    def _fresh_namespace(name):
        return {"__name__": name, "__builtins__": builtins}

    def op_stdin(self, request):
        self._begin(request["index"], request["input"])
        self.namespace = self._fresh_namespace("__main__")
        status, error = "ok", ""
        try:
            exec(self.code, self.namespace)
        except SystemExit as exc:  # exit() after printing the answer is normal for stdin programs
            if exc.code not in (None, 0):
                status, error = "error", f"SystemExit: exit status {exc.code!r}"
        except BaseException as exc:  # noqa: BLE001 -- the program's own errors are the test result
            status, error = "error", _describe(exc, self.source_lines)
        stdout, stderr, stream_error = self._end()
        if stream_error and (status == "ok" or stream_error.startswith(_OUTPUT_LIMIT)):
            status, error = "error", stream_error
        return {"status": status, "output": stdout, "error": error, "stderr": stderr}

    def op_functional(self, request):
        self._begin(request["index"], "")
        self.namespace = self._fresh_namespace("solution")
        self.namespace.update({name: getattr(typing, name) for name in typing.__all__})  # LeetCode starter code
        status, output, error = "ok", "", ""
        try:
            exec(self.code, self.namespace)
            target = self.namespace.get("Solution")
            if isinstance(target, type):
                target = getattr(target(), request["fn_name"], None)
            else:
                target = self.namespace.get(request["fn_name"])
            if not callable(target):
                raise NameError(f"the program defines no function or Solution method named {request['fn_name']!r}")
            args = [json.loads(line) for line in request["input"].split("\n") if line.strip()]
            output = to_json(target(*args))
        except SystemExit as exc:
            status, error = "error", _exit_text(exc)
        except BaseException as exc:  # noqa: BLE001
            status, error = "error", _describe(exc, self.source_lines)
        stdout, stderr, stream_error = self._end()
        if len(output) > self.output_limit:
            stream_error, output = f"{_OUTPUT_LIMIT}: the program wrote more than {self.output_limit} bytes", ""
        if stream_error and (status == "ok" or stream_error.startswith(_OUTPUT_LIMIT)):
            status, error = "error", stream_error
        debug = (stdout + "\n" + stderr).strip() if stdout else stderr
        return {"status": status, "output": output, "error": error, "stderr": debug}

    def op_load(self, request):
        """Run the program for an assert test; returns the names it defines (callables as proxies)."""
        self._begin(request["index"], "")
        self.namespace = self._fresh_namespace("__main__")
        try:
            exec(self.code, self.namespace)
        except SystemExit as exc:
            return {"error": _exit_text(exc)}
        except BaseException as exc:  # noqa: BLE001
            return {"error": _describe(exc, self.source_lines)}
        names = {}
        for name, value in list(self.namespace.items()):
            if name.startswith("__") or isinstance(value, type(sys)):
                continue
            if callable(value):
                names[name] = "callable"
            else:
                try:
                    names[name] = ["value", encode(value)]
                except (TypeError, ValueError, RecursionError):
                    continue  # a value the tests cannot use as such
        return {"names": names}

    def op_call(self, request):
        try:
            args, kwargs = decode(request["args"]), decode(request["kwargs"])
            value = self.namespace[request["name"]](*args, **kwargs)
            return {"value": encode(value)}
        except SystemExit as exc:
            return {"error": _exit_text(exc), "type": "SystemExit"}
        except CodecError as exc:
            return {"error": f"{request['name']}() returned {exc}", "type": "TypeError"}
        except BaseException as exc:  # noqa: BLE001
            return {"error": _describe(exc, self.source_lines), "type": type(exc).__name__}

    def op_finish(self, request):
        stdout, stderr, error = self._end()
        debug = (stdout + "\n" + stderr).strip() if stdout else stderr
        return {"stderr": debug, "error": error}


def _drop_to(uid):
    """Process isolation as root: keep the standard library importable through descriptors opened
    now (its folders may not be readable by `uid`), then become `uid`."""
    paths = []
    for path in sys.path:
        if path and os.path.isdir(path):
            paths.append(f"/proc/self/fd/{os.open(path, os.O_RDONLY | os.O_DIRECTORY)}")
    sys.path[:] = paths
    sys.path_importer_cache.clear()
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)


def _start_runner(guard, uid, output_limit):
    """Fork the runner; returns (channel to it, its pid). Called before the job is read."""
    to_runner, from_runner = os.pipe(), os.pipe()
    pid = os.fork()
    if pid:
        os.close(to_runner[0])
        os.close(from_runner[1])
        return _Channel(from_runner[0], to_runner[1], max_bytes=4 * output_limit + (1 << 20)), pid
    start = 3
    for fd in sorted((to_runner[0], from_runner[1])):
        os.closerange(start, fd)  # the report pipe, the job and the judge's ends: out of the program's reach
        start = fd + 1
    os.closerange(start, 65536)
    if uid is not None:
        _drop_to(uid)
    if guard == "guard":
        stdlib = [p for p in sys.path if p]
        install_guard(workdir=os.getcwd(), read_roots=stdlib + ["/dev/null", "/dev/zero", "/dev/urandom"])
    channel = _Channel(to_runner[0], from_runner[1], max_bytes=1 << 40)
    _Runner(channel, output_limit).serve()
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
            error = _describe(exc, [])
        except BaseException as exc:  # noqa: BLE001 -- the test code failed on what the program returned
            status, error = "error", self.failure or _describe(exc, [])
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
                self.send({"event": "result", "index": 0, "status": "error", "output": "", "error": compiled["error"],
                           "stderr": ""})
                return
            for index in range(n):
                self.send({"event": "start", "index": index})
                self.send({"event": "result", "index": index, **self.run_test(index)})
        except _ProgramFailed as exc:  # the runner is gone: this test failed, the rest cannot run
            self.send({"event": "result", "index": index, "status": "error", "output": "", "error": str(exc),
                       "stderr": ""})
            for rest in range(index + 1, n):
                self.send({"event": "start", "index": rest})
                self.send({"event": "result", "index": rest, "status": "not_run", "output": "",
                           "error": "not run: an earlier test stopped the run", "stderr": ""})


def run(job_source, result_fd, guard, uid, limits):
    """The judge: limits, then the runner (forked before the job is read), then the tests."""
    if job_source.isdigit():
        job_file = os.fdopen(int(job_source), "rb", buffering=0)
    else:
        job_file = open(job_source, "rb", buffering=0)  # root-only: opened before the runner drops its uid
    if limits["cgroup_procs"]:  # process isolation as root: the judge joins the memory cgroup itself
        with open(limits["cgroup_procs"], "w") as f:
            f.write("0")
    _set_limits(limits["rlimits"])
    _prctl(_PR_SET_DUMPABLE, 0)  # no same-uid process may read this one's descriptors or memory
    runner, pid = _start_runner(guard, None if uid == "-" else int(uid), limits["output_limit"])
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
