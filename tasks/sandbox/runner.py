"""The runner of the code sandbox: the only process that executes the program (see
tasks/sandbox/harness.py, which forks it). Standard library only: copied into the sandbox beside
the harness and imported there as `sandbox_runner`.

It serves the judge's requests over a private pipe pair, one at a time: `program` (compile),
`stdin` / `functional` (run one test, answer with its output), `load` / `call` / `finish` (an
assert test: run the program, call its functions with plain values, return the captured streams).
"""

import builtins
import gc
import io
import json
import os
import sys
import traceback
import typing

from sandbox_codec import CodecError, decode, encode, to_json

SOLUTION = "<solution>"
_MAX_ERROR_CHARS = 2000
_MAX_STDERR = 4096
OUTPUT_LIMIT = "Output Limit Exceeded"


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


class Runner:
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
            detail = describe(exc, self.source_lines)
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
            error = f"{OUTPUT_LIMIT}: the program wrote more than {self.output_limit} bytes"
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
            status, error = "error", describe(exc, self.source_lines)
        stdout, stderr, stream_error = self._end()
        if stream_error and (status == "ok" or stream_error.startswith(OUTPUT_LIMIT)):
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

    def op_load(self, request):
        """Run the program for an assert test; returns the names it defines (callables as proxies)."""
        self._begin(request["index"], "")
        self.namespace = self._fresh_namespace("__main__")
        try:
            exec(self.code, self.namespace)
        except SystemExit as exc:
            return {"error": exit_text(exc)}
        except BaseException as exc:  # noqa: BLE001
            return {"error": describe(exc, self.source_lines)}
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
            return {"error": exit_text(exc), "type": "SystemExit"}
        except CodecError as exc:
            return {"error": f"{request['name']}() returned {exc}", "type": "TypeError"}
        except BaseException as exc:  # noqa: BLE001
            return {"error": describe(exc, self.source_lines), "type": type(exc).__name__}

    def op_finish(self, request):
        stdout, stderr, error = self._end()
        debug = (stdout + "\n" + stderr).strip() if stdout else stderr
        return {"stderr": debug, "error": error}
