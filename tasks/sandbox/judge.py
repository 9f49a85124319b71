"""The judge inside the code sandbox (see tasks/sandbox/harness.py, which imports it as
sandbox_judge). Standard library only.

It asks the zygote for one fresh call process per test (per call, for assert tests), reports each
test's raw output over the report pipe, and judges assert-style tests itself: each test's code runs
in a namespace that takes only the suite's entry points from the program, called through proxies
whose results come back as plain values (sandbox_codec). It never runs the program's code itself.
"""

import builtins
import json
import os
import signal
import traceback

from sandbox_codec import Channel, CodecError, decode, encode
from sandbox_runner import answer_bytes, describe

_MAX_DEBUG = 4096  # the program's output shown with one assert test
TEST_FILES = ("<test>", "<test-setup>")


class _ProgramFailed(Exception):
    """The program raised, exited or crashed during a call of an assert test."""


class SandboxGone(Exception):
    """The zygote is gone or could not clean up after a call: the run cannot go on."""


def _status_text(status):
    if os.WIFSIGNALED(status):
        return f"the program crashed (killed by {signal.Signals(os.WTERMSIG(status)).name})"
    return f"the program ended the test run abruptly (exit status {os.WEXITSTATUS(status)})"


class Judge:
    def __init__(self, job, zygote, zygote_pid, report_fd, output_limit):
        self.job, self.zygote, self.zygote_pid = job, zygote, zygote_pid
        self.control = Channel(zygote.fileno(), zygote.fileno(), max_bytes=1 << 20)
        self.answer_bytes = answer_bytes(output_limit)
        self.report = os.fdopen(report_fd, "w", encoding="utf-8", buffering=1)
        self.failure, self.stderr, self.stream_error = "", "", ""
        self.gone = ""  # why the zygote is gone, once it is: no call can run after that

    def send(self, message):
        self.report.write(json.dumps(message) + "\n")
        self.report.flush()

    def _zygote_gone(self):
        os.kill(self.zygote_pid, signal.SIGKILL)  # unreaped, so the pid is still the zygote's
        self.gone = _status_text(os.waitpid(self.zygote_pid, 0)[1])
        raise SandboxGone(self.gone)

    def zygote_says(self):
        if self.gone:
            raise SandboxGone(self.gone)
        try:
            message = self.control.receive()
        except (ValueError, RecursionError):
            message = None
        if message is None:
            self._zygote_gone()
        return message

    def _pipes(self):
        """A new call: the judge's ends (write, read) of the pipe pair the zygote made for it."""
        import socket  # loaded by run() after the zygote was forked

        try:
            self.control.send({"op": "call"})
            message, fds, _, _ = socket.recv_fds(self.zygote, 1, 2)
        except OSError:
            message, fds = b"", []
        if message != b"s" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            self._zygote_gone()
        return fds

    def ask(self, request):
        """The answer of a fresh call process to `request`; _ProgramFailed when it died or answered
        garbage, SandboxGone when the zygote did."""
        if self.gone:
            raise SandboxGone(self.gone)
        to_call, from_call = self._pipes()
        channel = Channel(from_call, to_call, max_bytes=self.answer_bytes)
        try:
            channel.send(request)
            answer = channel.receive()
        except OSError:  # a closed pipe: the call process is gone
            answer = None
        except (ValueError, RecursionError):
            answer = "corrupt"
        finally:
            os.close(to_call)
            os.close(from_call)
        done = self.zygote_says()  # the call process and all it left are gone now
        if done.get("error"):
            self.gone = str(done["error"])
            raise SandboxGone(self.gone)
        if answer == "corrupt":
            raise _ProgramFailed("the program corrupted the sandbox's report channel")
        if answer is None:
            raise _ProgramFailed(_status_text(int(done["status"])))
        return answer

    def call(self, index, name, args, kwargs):
        try:
            request = {"op": "call", "index": index, "name": name, "args": encode(args), "kwargs": encode(kwargs)}
        except CodecError as exc:
            raise _ProgramFailed(f"the test passes {name}() a value the sandbox cannot send: {exc}") from None
        try:
            answer = self.ask(request)
        except _ProgramFailed as exc:
            self.failure = self.failure or str(exc)
            raise
        if len(self.stderr) < _MAX_DEBUG and answer.get("stderr"):
            self.stderr = (self.stderr + "\n" + str(answer["stderr"])).strip()[:_MAX_DEBUG]
        self.stream_error = self.stream_error or str(answer.get("stream_error") or "")
        if "error" in answer:
            self.failure = self.failure or str(answer["error"])
            raise _ProgramFailed(str(answer["error"]))
        return decode(answer["value"])

    def proxy(self, index, name):
        def proxy(*args, **kwargs):
            return self.call(index, name, args, kwargs)

        proxy.__name__ = proxy.__qualname__ = name
        return proxy

    def run_assert(self, index):
        """The test code, here in the judge, in a namespace of the judge's builtins, the setup and
        the entry points; each call of an entry point runs in a fresh call process. A call that
        failed (raised, exited, crashed) fails the test even when the test code caught the error."""
        self.failure, self.stderr, self.stream_error = "", "", ""
        status, error = "ok", ""
        namespace = {"__name__": "__test__", "__builtins__": builtins}
        namespace.update({name: self.proxy(index, name) for name in self.job["entry_points"]})
        try:
            if self.job["setup"]:
                exec(compile(self.job["setup"], "<test-setup>", "exec"), namespace)
            exec(compile(self.job["inputs"][index], "<test>", "exec"), namespace)
        except SandboxGone:
            raise  # run() reports this test and skips the rest
        except _ProgramFailed as exc:
            status, error = "error", str(exc)
        except AssertionError as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            status = "failed" if frames and frames[-1].filename in TEST_FILES else "error"
            error = describe(exc, [])
        except BaseException as exc:  # noqa: BLE001 -- the test code failed on what the program returned
            status, error = "error", self.failure or describe(exc, [])
        if self.gone:
            raise SandboxGone(self.gone)
        if self.failure and status == "ok":
            status, error = "error", self.failure
        if self.stream_error and status == "ok":
            status, error = "error", self.stream_error
        return {"status": status, "output": "", "error": error, "stderr": self.stderr}

    def run_test(self, index):
        kind = self.job["testtype"]
        if kind == "assert":
            return self.run_assert(index)
        request = {"op": kind, "index": index, "input": self.job["inputs"][index], "fn_name": self.job["fn_name"]}
        try:
            answer = self.ask(request)
        except _ProgramFailed as exc:
            return {"status": "error", "output": "", "error": str(exc), "stderr": ""}
        return {key: str(answer.get(key, "")) for key in ("status", "output", "error", "stderr")}

    def run(self, compile_error):
        n = len(self.job["inputs"])
        if compile_error:
            self.send({"event": "start", "index": 0})
            self.send(
                {"event": "result", "index": 0, "status": "error", "output": "", "error": compile_error, "stderr": ""}
            )
            return
        index = 0
        try:
            for index in range(n):
                self.send({"event": "start", "index": index})
                self.send({"event": "result", "index": index, **self.run_test(index)})
        except SandboxGone as exc:  # this test failed, the rest cannot run
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
