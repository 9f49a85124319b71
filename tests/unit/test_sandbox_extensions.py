"""The audit behind the code sandbox's Python guard (tasks/sandbox/guard.py and extensions.py).

Native code acts below the guard's audit hook, so the guard must know every native module and
every posix function of the interpreter the sandbox starts: each extension module is allowed with
the reason it reaches nothing unseen, or refused; each posix function raises the audit event the
guard checks, is removed, or is classified below as harmless. A module or function that a newer
Python adds fails these tests until it is classified. The hook itself must read nothing the
program can rewrite, which the last tests check on its bytecode and its decisions."""

from __future__ import annotations

import dis
import json
import os
import subprocess
import sys
import types

import pytest

from tasks.sandbox import guard
from tasks.sandbox.extensions import ALLOWED, REFUSED

SANDBOX_PYTHON = os.path.realpath(sys._base_executable)  # what tasks/sandbox/isolation.py starts


def _sandbox_interpreter():
    """(standard-library folders, built-in module names, extension suffixes, posix functions) of
    the interpreter as the sandbox starts it (`python -I -S`)."""
    probe = (
        "import _imp, json, posix, sys\n"
        "functions = sorted(n for n in dir(posix) if callable(getattr(posix, n)) and not isinstance(getattr(posix, n), type))\n"
        "print(json.dumps([sys.path, list(sys.builtin_module_names), _imp.extension_suffixes(), functions]))"
    )
    out = subprocess.run([SANDBOX_PYTHON, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


FOLDERS, BUILTIN, SUFFIXES, POSIX_FUNCTIONS = _sandbox_interpreter()


def _extension_files():
    found = {}
    for folder in FOLDERS:
        if not os.path.isdir(folder):
            continue
        for entry in sorted(os.listdir(folder)):
            suffix = next((s for s in SUFFIXES if entry.endswith(s)), None)
            if suffix is not None:
                found[entry[: -len(suffix)]] = os.path.join(folder, entry)
    return found


def test_every_extension_module_of_the_sandbox_interpreter_is_allowed_or_refused():
    modules = set(BUILTIN) | set(_extension_files())
    assert len(modules) > 60, (FOLDERS, modules)  # the audit found the library (107 on Python 3.11)
    unclassified = sorted(modules - set(ALLOWED) - set(REFUSED))
    assert not unclassified, f"classify these in tasks/sandbox/extensions.py (ALLOWED or REFUSED): {unclassified}"
    assert not set(ALLOWED) & set(REFUSED)
    assert all(reason.strip() for reason in (*ALLOWED.values(), *REFUSED.values()))


def test_the_modules_that_reach_files_unseen_are_refused():
    for name in ("readline", "_sqlite3", "_dbm", "_gdbm", "_tkinter", "_curses", "_ssl", "_hashlib", "_uuid"):
        assert name in REFUSED, name
    for name in ("_ctypes", "mmap", "_posixsubprocess", "_multiprocessing", "_posixshmem", "_socket", "pwd", "grp"):
        assert name in REFUSED, name


# -- posix ------------------------------------------------------------------------------------------
# Functions of posix that raise an audit event, with the event; the guard checks or refuses each.
AUDITED = {
    "open": "open",
    "chdir": "os.chdir",
    "chmod": "os.chmod",
    "chown": "os.chown",
    "lchown": "os.chown",
    "listdir": "os.listdir",
    "scandir": "os.scandir",
    "mkdir": "os.mkdir",
    "remove": "os.remove",
    "unlink": "os.remove",
    "rename": "os.rename",
    "replace": "os.rename",
    "rmdir": "os.rmdir",
    "link": "os.link",
    "symlink": "os.symlink",
    "truncate": "os.truncate",
    "ftruncate": "os.truncate",
    "utime": "os.utime",
    "getxattr": "os.getxattr",
    "listxattr": "os.listxattr",
    "setxattr": "os.setxattr",
    "removexattr": "os.removexattr",
    "kill": "os.kill",
    "killpg": "os.killpg",
    "fork": "os.fork",
    "forkpty": "os.forkpty",
    "execv": "os.exec",
    "execve": "os.exec",
    "posix_spawn": "os.posix_spawn",
    "posix_spawnp": "os.posix_spawn",
    "system": "os.system",
    "putenv": "os.putenv",
    "unsetenv": "os.unsetenv",
    "lockf": "os.lockf",
}
HARMLESS = {
    "descriptors the program holds": (
        "close closerange dup dup2 read write readv writev pread pwrite preadv pwritev lseek fstat fstatvfs "
        "fsync fdatasync fpathconf isatty ttyname device_encoding get_blocking set_blocking get_inheritable "
        "set_inheritable pipe pipe2 eventfd eventfd_read eventfd_write copy_file_range sendfile splice "
        "posix_fadvise posix_fallocate get_terminal_size tcgetpgrp tcsetpgrp timerfd_create timerfd_gettime "
        "timerfd_gettime_ns timerfd_settime timerfd_settime_ns"
    ),
    "the program's own process": (
        "umask nice sched_yield sched_getaffinity sched_getparam sched_getscheduler sched_rr_get_interval "
        "sched_get_priority_max sched_get_priority_min getpriority getpid getppid getpgid getpgrp getsid getuid "
        "geteuid getgid getegid getgroups getresuid getresgid times wait wait3 wait4 waitid waitpid "
        "register_at_fork abort _exit getcwd getcwdb _inputhook _is_inputhook_installed"
    ),
    "information about the machine, no file content": "urandom getrandom cpu_count getloadavg uname sysconf confstr",
    "flushes the file systems' caches, reaching no file": "sync",
    "metadata of a path (existence, size, times, link target), never its content": (
        "stat lstat access readlink statvfs pathconf"
    ),
    "needs a capability the program never has": (
        "chroot setuid seteuid setgid setegid setreuid setregid setresuid setresgid setgroups initgroups"
    ),
    "computes on its arguments": (
        "fspath major minor makedev strerror ctermid waitstatus_to_exitcode _path_normpath _path_splitroot_ex "
        "WCOREDUMP WEXITSTATUS WIFCONTINUED WIFEXITED WIFSIGNALED WIFSTOPPED WSTOPSIG WTERMSIG"
    ),
}


def test_every_posix_function_is_audited_removed_or_harmless():
    removed = set(guard._REMOVED["posix"])
    harmless = {name for names in HARMLESS.values() for name in names.split()}
    groups = [removed, set(AUDITED), harmless]
    assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1 :])
    unclassified = sorted(set(POSIX_FUNCTIONS) - removed - set(AUDITED) - harmless)
    assert not unclassified, f"classify these posix functions here and in tasks/sandbox/guard.py: {unclassified}"


# arguments that reach the audit event of each AUDITED function (the probe stops the call there)
_PROBE = """
import os, posix, sys
class Stop(BaseException):
    pass
def hook(event, args):
    if armed:
        raise Stop(event)
armed = False
sys.addaudithook(hook)
F = sys.argv[1]
fd = os.open(F, os.O_RDWR)
calls = {
    "open": (F, 0), "chdir": ("/",), "chmod": (F, 0o644), "chown": (F, -1, -1), "lchown": (F, -1, -1),
    "listdir": ("/",), "scandir": ("/",), "mkdir": (F + "d",), "remove": (F + "x",), "unlink": (F + "x",),
    "rename": (F + "x", F + "y"), "replace": (F + "x", F + "y"), "rmdir": (F + "d",), "link": (F, F + "l"),
    "symlink": (F, F + "s"), "truncate": (F, 0), "ftruncate": (fd, 0), "utime": (F,), "getxattr": (F, "user.x"),
    "listxattr": (F,), "setxattr": (F, "user.x", b"1"), "removexattr": (F, "user.x"), "kill": (os.getpid(), 0),
    "killpg": (os.getpgrp(), 0), "fork": (), "forkpty": (), "execv": ("/bin/true", ["true"]),
    "execve": ("/bin/true", ["true"], {}), "posix_spawn": ("/bin/true", ["true"], {}),
    "posix_spawnp": ("true", ["true"], {}), "system": ("true",), "putenv": ("X", "y"), "unsetenv": ("X",),
    "lockf": (fd, os.F_TEST, 0),
}
seen = {}
for name, args in calls.items():
    armed = True
    try:
        getattr(posix, name)(*args)
        seen[name] = None
    except Stop as stop:
        seen[name] = str(stop)
    armed = False
print(repr(seen))
"""


def test_the_audited_posix_functions_raise_their_events(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    out = subprocess.run(
        [SANDBOX_PYTHON, "-I", "-S", "-c", _PROBE, str(target)], capture_output=True, text=True, check=True
    )
    seen = eval(out.stdout)  # noqa: S307 -- the probe's own repr of a dict of strings
    assert seen == {name: event for name, event in AUDITED.items() if name in POSIX_FUNCTIONS}


# -- the hook reads nothing the program can rewrite ---------------------------------------------------
_GLOBAL_READS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "STORE_GLOBAL", "IMPORT_NAME"}
_IMMUTABLE = (
    str,
    bytes,
    int,
    float,
    bool,
    type(None),
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
)


def _hook(tmp_path, **changes):
    (tmp_path / "work").mkdir(exist_ok=True)
    (tmp_path / "lib").mkdir(exist_ok=True)
    settings = {
        "workdir": str(tmp_path / "work"),
        "read_roots": [str(tmp_path / "lib"), "/dev/null"],
        "extension_files": {("math", f"{tmp_path}/lib/math.so")},
        "refused_modules": {"readline"},
        "builtin_modules": {"posix"},
        **changes,
    }
    return guard._make_hook(**settings)


def _functions_and_values(function, seen):
    """Every Python function the hook can reach through its defaults, and every other default value."""
    if function in seen:
        return
    seen.add(function)
    assert function.__closure__ is None, function
    assert function.__kwdefaults__ is None, function
    stack = list(function.__defaults__ or ())
    while stack:
        value = stack.pop()
        if value is vars(guard):
            continue  # compared by identity only: which functions are the guard's
        if isinstance(value, types.FunctionType):
            _functions_and_values(value, seen)
        elif type(value) in (tuple, frozenset):
            stack.extend(value)
        else:
            built_in_class = isinstance(value, type) and value.__module__ == "builtins"
            assert type(value) in _IMMUTABLE or built_in_class, (function, value)


def test_the_hook_and_its_helpers_read_no_global_name_and_hold_only_immutable_values(tmp_path):
    functions = set()
    _functions_and_values(_hook(tmp_path), functions)
    assert len(functions) >= 5
    for function in functions:
        codes = [function.__code__]
        while codes:
            code = codes.pop()
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            reads = {i.opname for i in dis.get_instructions(code)} & _GLOBAL_READS
            assert not reads, (function, reads)


class _Liar(str):
    """A path whose own methods say it is inside the working directory."""

    def startswith(self, *args):
        return True

    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


class _PathLike:
    def __fspath__(self):
        return "inside"


@pytest.mark.parametrize(
    ("event", "args"),
    [
        ("open", ("/etc/passwd", "r", 0)),
        ("open", ("../lib/x", "r", 0)),  # '..' is refused even where it lands inside
        ("open", ("{work}/../../etc/passwd", "r", 0)),
        ("open", ("{lib}x/file", "r", 0)),  # a sibling folder whose name starts like a root
        ("open", ("{lib}/file", "w", 0)),
        ("open", ("{lib}/file", None, os.O_WRONLY)),
        ("open", ("{lib}", "r", 0)),  # a directory outside the working directory
        ("open", (_Liar("/etc/passwd"), "r", 0)),
        ("open", (_PathLike(), "r", 0)),
        ("os.listdir", ("/",)),
        ("os.mkdir", ("/tmp/x", 0o777, -1)),
        ("os.rename", ("inside", "/tmp/x", -1, -1)),
        ("os.chmod", (3, 0o777, None)),  # a descriptor: it may name a file outside
        ("os.symlink", ("inside", "link", None)),
        ("os.chdir", ("{work}",)),
        ("os.putenv", ("TZ", "/etc/passwd")),
        ("os.system", ("true",)),
        ("socket.connect", (None, ("127.0.0.1", 1))),
        ("ctypes.dlopen", ("libc.so.6",)),
        ("object.__setattr__", (guard._deny, "__code__", None)),
        ("object.__setattr__", (guard._text, "__defaults__", ())),
        ("object.__delattr__", (guard._under, "__defaults__")),  # f.__defaults__ = None
        ("resource.prlimit", (1, 7, (1, 1))),
    ],
)
def test_the_hook_refuses(event, args, tmp_path):
    hook = _hook(tmp_path)
    work, lib = str(tmp_path / "work"), str(tmp_path / "lib")
    args = tuple(a.format(work=work, lib=lib) if type(a) is str else a for a in args)
    with pytest.raises(PermissionError, match="sandbox: "):
        hook(event, args)


@pytest.mark.parametrize(
    "args",
    [
        ("readline", None, [], [], []),  # an import statement of a refused module
        ("posix", None, [], [], []),  # a second copy of a built-in module
        ("math", "{work}/math.so", None, None, None),  # an allowed name from another file
        ("readline", "{lib}/readline.so", None, None, None),  # a refused module from the library
        ("math", _Liar("{work}/math.so"), None, None, None),  # says it equals the allowed file
        ("math", None, None, None, None),  # a spec without an origin
    ],
)
def test_the_hook_refuses_native_modules(args, tmp_path):
    hook = _hook(tmp_path)
    work, lib = str(tmp_path / "work"), str(tmp_path / "lib")
    args = tuple(type(a)(a.format(work=work, lib=lib)) if isinstance(a, str) else a for a in args)
    with pytest.raises((ImportError, PermissionError), match="sandbox: "):
        hook("import", args)


@pytest.mark.parametrize(
    ("event", "args"),
    [
        ("open", ("answer.txt", "w", 0)),
        ("open", ("{work}/sub/./answer.txt", None, os.O_CREAT | os.O_WRONLY)),
        ("open", ("{lib}/json/__init__.py", "rb", 0)),
        ("open", ("/dev/null", "r", 0)),
        ("open", (5, "r", 0)),
        ("os.listdir", ("{lib}",)),
        ("os.scandir", (None,)),
        ("os.mkdir", ("sub", 0o777, -1)),
        ("os.rename", ("a", "{work}/b", -1, -1)),
        ("import", ("json", None, [], [], [])),
        ("import", ("math", "{lib}/math.so", None, None, None)),
        ("resource.prlimit", (0, 7, (1, 1))),
        ("object.__setattr__", (int, "__doc__", None)),
        ("object.__setattr__", (lambda: None, "__defaults__", (1,))),  # a function of the program's
        ("compile", (b"", "<string>")),
    ],
)
def test_the_hook_allows(event, args, tmp_path):
    hook = _hook(tmp_path)
    work, lib = str(tmp_path / "work"), str(tmp_path / "lib")
    args = tuple(a.format(work=work, lib=lib) if type(a) is str else a for a in args)
    assert hook(event, args) is None


def test_the_extension_tables_are_copied_into_the_sandbox_and_import_nothing():
    from pathlib import Path

    from tasks.sandbox.isolation import HARNESS_FILES

    copied = {(source.name, name) for source, name in HARNESS_FILES}
    assert ("extensions.py", "sandbox_extensions.py") in copied
    source = (Path(guard.__file__).parent / "extensions.py").read_text()
    assert not [line for line in source.splitlines() if line.startswith(("import ", "from "))]
