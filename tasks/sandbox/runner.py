"""The processes of the code sandbox that touch the program (see tasks/sandbox/harness.py, which
forks the zygote). Standard library only: copied into the sandbox beside the harness and imported
there as `sandbox_runner`.

The **zygote** never runs the program. It compiles it once, then for each request of the judge
forks a **call process** that runs the program for that one request and exits; the zygote then
removes whatever the call left behind (processes, files in the working directory) before it reports
to the judge. Each call gets a fresh pipe pair, made by the zygote, whose far ends reach the judge
over the control socket, so requests and answers never pass through the zygote, and no call process
inherits anything of an earlier call: not its memory, not its files, not its processes.

With the guard, a call process installs it (tasks/sandbox/guard.py, which admits only the extension
modules of tasks/sandbox/extensions.py) before it reads its request, so nothing the program can
reach may have been loaded in the zygote: the zygote never loads ctypes nor the socket module. The
descriptors go to the judge from a short-lived child of the zygote that loads `_socket` and exits;
prctl (ctypes) is used only without the guard, where the program may load ctypes itself.

A call process answers one request: `stdin` / `functional` (run one test, answer with its output)
or `call` (an assert test's call of one entry point: run the program, call the function with plain
values, answer with a plain value and the captured streams).
"""

import builtins
import errno
import io
import json
import os
import shutil
import signal
import sys
import traceback
import typing

from sandbox_codec import Channel, CodecError, decode, encode, to_json
from sandbox_extensions import ALLOWED, REFUSED
from sandbox_guard import install_guard, prepare_guard

SOLUTION = "<solution>"
_MAX_ERROR_CHARS = 2000
_MAX_STDERR = 4096
OUTPUT_LIMIT = "Output Limit Exceeded"
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 4, 36


def answer_bytes(output_limit):
    """The most one answer may take on a pipe: JSON escapes a byte as up to 6 (a control character
    is \\u00XX), so an output just under the limit still fits, plus room for the other fields."""
    return 6 * output_limit + (1 << 20)


def describe(exc, source_lines):
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


def exit_text(exc):
    return f"the program called exit() during a test (SystemExit: {exc.code!r}); a test only passes by finishing"


def _redirect(fd, path, flags):
    new = os.open(path, flags, 0o600)
    if new != fd:
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


def _prctl(option, value):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


def _xattrs(path):
    try:
        return os.listxattr(path)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return []  # a file system without extended attributes: none to remove
        raise


class Call:
    """One request, run by a call process: the program's module code, then the test or the call."""

    def __init__(self, code, source_lines, output_limit):
        self.code, self.source_lines, self.output_limit = code, source_lines, output_limit

    def answer(self, request):
        return getattr(self, "op_" + request["op"])(request)

    @staticmethod
    def _begin(stdin_text):
        with open(".stdin", "w", encoding="utf-8") as f:
            f.write(stdin_text)
        _redirect(0, ".stdin", os.O_RDONLY)
        _redirect(1, ".stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        _redirect(2, ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
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
        stdout, over = _read_capped(".stdout", self.output_limit)
        stderr, _ = _read_capped(".stderr", _MAX_STDERR)
        if over or os.path.getsize(".stdout") >= self.output_limit:
            error = f"{OUTPUT_LIMIT}: the program wrote more than {self.output_limit} bytes"
        return stdout, stderr, error

    def op_stdin(self, request):
        self._begin(request["input"])
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        status, error = "ok", ""
        try:
            exec(self.code, namespace)
        except SystemExit as exc:  # exit() after printing the answer is normal for stdin programs
            if exc.code not in (None, 0):
                status, error = "error", f"SystemExit: exit status {exc.code!r}"
        except BaseException as exc:  # noqa: BLE001 -- the program's own errors are the test result
            status, error = "error", describe(exc, self.source_lines)
        stdout, stderr, stream_error = self._end()
        if stream_error and (status == "ok" or stream_error.startswith(OUTPUT_LIMIT)):
            status, error = "error", stream_error
        return {"status": status, "output": stdout, "error": error, "stderr": stderr}

    def op_functional(self, request):
        self._begin("")
        namespace = {"__name__": "solution", "__builtins__": builtins}
        namespace.update({name: getattr(typing, name) for name in typing.__all__})  # LeetCode starter code
        status, output, error = "ok", "", ""
        try:
            exec(self.code, namespace)
            target = namespace.get("Solution")
            if isinstance(target, type):
                target = getattr(target(), request["fn_name"], None)
            else:
                target = namespace.get(request["fn_name"])
            if not callable(target):
                raise NameError(f"the program defines no function or Solution method named {request['fn_name']!r}")
            args = [json.loads(line) for line in request["input"].split("\n") if line.strip()]
            output = to_json(target(*args))
        except SystemExit as exc:
            status, error = "error", exit_text(exc)
        except BaseException as exc:  # noqa: BLE001
            status, error = "error", describe(exc, self.source_lines)
        stdout, stderr, stream_error = self._end()
        if len(output) > self.output_limit:
            stream_error, output = f"{OUTPUT_LIMIT}: the program wrote more than {self.output_limit} bytes", ""
        if stream_error and (status == "ok" or stream_error.startswith(OUTPUT_LIMIT)):
            status, error = "error", stream_error
        debug = (stdout + "\n" + stderr).strip() if stdout else stderr
        return {"status": status, "output": output, "error": error, "stderr": debug}

    def op_call(self, request):
        """An assert test's call of the entry point `name`: {"value"} or {"error"}, with "stderr" (the
        program's output, as debug text) and "stream_error" (output past the limit)."""
        self._begin("")
        namespace = {"__name__": "solution", "__builtins__": builtins}
        name, answer = request["name"], {}
        try:
            exec(self.code, namespace)
            target = namespace.get(name)
            if not callable(target):
                raise NameError(f"the program defines no function named {name!r}")
            answer["value"] = encode(target(*decode(request["args"]), **decode(request["kwargs"])))
        except SystemExit as exc:
            answer["error"] = exit_text(exc)
        except CodecError as exc:
            answer["error"] = f"{name}() returned {exc}"
        except BaseException as exc:  # noqa: BLE001
            answer["error"] = describe(exc, self.source_lines)
        stdout, stderr, answer["stream_error"] = self._end()
        answer["stderr"] = (stdout + "\n" + stderr).strip() if stdout else stderr
        return answer


class Zygote:
    """Forks one call process per request of the judge and cleans up after it (see the module
    docstring). `control`: the descriptor of the zygote's end of the control socket. `sweep`: kill
    every other process of the sandbox after each call (only where the judge is the init of the
    sandbox's own pid namespace, so nothing else can be reached)."""

    def __init__(self, control, program, *, guard, output_limit, sweep):
        self.control_fd, self.guard, self.output_limit, self.sweep = control, guard, output_limit, sweep
        self.control = Channel(control, control, max_bytes=1 << 20)
        self.reaper = False  # whether what a call leaves running comes back here (PR_SET_CHILD_SUBREAPER)
        self.workdir = os.getcwd()
        if guard:  # read once here, not in every call process
            stdlib = [p for p in sys.path if p]  # as root: /proc/self/fd/N, pinned by the judge
            read_roots = stdlib + ["/dev/null", "/dev/zero", "/dev/urandom"]
            self.prepared_guard = prepare_guard(workdir=self.workdir, read_roots=read_roots, allowed=ALLOWED)
        self.source_lines = program.splitlines()
        self.code, self.compile_error = None, ""
        try:
            self.code = compile(program, SOLUTION, "exec")
        except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError) as exc:
            self.compile_error = describe(exc, self.source_lines)
            if isinstance(exc, SyntaxError) and exc.lineno:
                self.compile_error = f"SyntaxError: {exc.msg}\nLine {exc.lineno}: {(exc.text or '').strip()}"

    def serve(self):
        if not self.guard:  # the program may load ctypes itself: loading it here gives nothing away
            _prctl(_PR_SET_DUMPABLE, 0)  # a call process (same uid) cannot read this one's memory or descriptors
            _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # what a call leaves running comes back here to be reaped
            self.reaper = True
        self.control.send({"error": self.compile_error})
        if self.code is None:
            return
        while self.control.receive() is not None:  # {"op": "call"}; None: the judge is gone
            to_call, from_call = os.pipe(), os.pipe()
            self._hand_over(to_call[1], from_call[0])
            os.close(to_call[1])
            os.close(from_call[0])
            pid = os.fork()
            if pid == 0:
                self._call(to_call[0], from_call[1])
            os.close(to_call[0])
            os.close(from_call[1])
            status = os.waitpid(pid, 0)[1]
            self.control.send({"status": status, "error": self._clean()})

    def _hand_over(self, *fds):
        """Send `fds` to the judge over the control socket, from a child that loads the socket
        module (refused by the guard) and exits, so that no call process inherits it."""
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                import _socket
                import struct

                sock = _socket.socket(fileno=self.control_fd)
                sock.sendmsg([b"s"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
                code = 0
            finally:
                os._exit(code)
        status = os.waitpid(pid, 0)[1]
        if status != 0:
            raise RuntimeError(f"sandbox: the zygote could not hand a call's pipes to the judge (wait status {status})")

    def _call(self, read_fd, write_fd):
        """The call process: the guard, then one request. Never returns (whatever the program raises
        from a signal handler or a finaliser ends here, not in the zygote's loop)."""
        try:
            os.close(self.control_fd)
            if self.guard:
                install_guard(self.prepared_guard, refused=REFUSED)
            channel = Channel(read_fd, write_fd, max_bytes=1 << 40)
            request = channel.receive()
            if request is not None:
                channel.send(Call(self.code, self.source_lines, self.output_limit).answer(request))
        finally:
            os._exit(0)

    def _clean(self):
        """Stop and reap whatever the call left running; empty the working directory and reset its
        own mode, times and extended attributes. Returns what could not be cleaned ("" when all was)."""
        while self.sweep:
            try:
                os.kill(-1, signal.SIGKILL)  # every process of the sandbox but the judge (init) and this one
            except ProcessLookupError:
                break
            if not self.reaper:  # the killed ones are the judge's (the init) to reap: kill once
                break
            self._reap()
        self._reap()
        try:
            os.chmod(self.workdir, 0o700)
            for entry in os.scandir(self.workdir):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            for name in _xattrs(self.workdir):
                os.removexattr(self.workdir, name)
            os.utime(self.workdir, ns=(0, 0))
        except OSError as exc:
            return f"the program left files in its working directory that could not be removed ({exc})"
        return ""

    @staticmethod
    def _reap():
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
