"""The native modules a sandboxed program may use: every extension module of the standard library
(built into the interpreter or a file of its lib-dynload folder), each allowed with the reason it
cannot reach a file, a process or the network unseen, or refused with what it could reach.

A C extension acts below the audit hook of tasks/sandbox/guard.py: whatever it does without
raising an audit event the guard never sees. So the guard allows only the modules named in
ALLOWED; any other module, a name missing from both tables (a module of a newer Python), a file
of site-packages or one the program writes, cannot be loaded once the program runs.
tests/unit/test_sandbox_extensions.py fails for a module of the running interpreter that neither
table names. Names of Python 3.10 to 3.13 builds are listed; a table may name a module the running
interpreter lacks.

Standard library only: copied into the sandbox beside the harness and imported there as
`sandbox_extensions`; the pipeline's tests import it as `tasks.sandbox.extensions`.
"""

_PURE = "computes on values in memory; no file, process or network access"
_CODEC = "text codecs over tables compiled into the module"
_HASH = "a hash function over bytes in memory"
_TEST = "one of CPython's own test modules: raw memory and interpreter internals, no use to a program"
_SUBINTERPRETERS = "starts sub-interpreters, which run code without the sandbox's audit hook"

ALLOWED = {
    # built into the interpreter (also loaded before the program runs)
    "_abc": _PURE,
    "_ast": "the parser's syntax trees; compiling raises the `compile` audit event",
    "_codecs": "codec registry and encoders; `codecs.open` goes through `open`, which the guard checks",
    "_collections": _PURE,
    "_functools": _PURE,
    "_imp": "the import machinery's primitives; the guard removes `create_builtin` and checks every file "
    "`create_dynamic` loads (the `import` audit event)",
    "_io": "file objects: every open raises the `open` audit event with its path and mode",
    "_locale": "locale conversions; the C library reads only the system's locale files, since the program "
    "cannot change the environment (the guard refuses putenv) and the gettext functions are removed",
    "_operator": _PURE,
    "_signal": "signal handlers of the program's own process; `pthread_kill` raises an audit event (refused)",
    "_sre": _PURE,
    "_stat": _PURE,
    "_string": _PURE,
    "_suggestions": "spelling suggestions for error messages",
    "_symtable": "symbol tables of source text in memory",
    "_sysconfig": "the interpreter's build configuration, a dict in memory",
    "_thread": "threads of the program's own process, within RLIMIT_NPROC",
    "_tokenize": _PURE,
    "_tracemalloc": "statistics of the program's own allocations",
    "_typing": _PURE,
    "_warnings": "warning filters; warnings go to sys.stderr",
    "_weakref": _PURE,
    "atexit": "exit callbacks of the program's own process",
    "builtins": "`open` raises the `open` audit event; `__import__` the `import` event",
    "errno": _PURE,
    "gc": "the program's own objects; `get_objects` / `get_referrers` / `get_referents` raise audit events",
    "itertools": _PURE,
    "marshal": "serialises values in memory; `dump` / `load` act on file objects the program opened through `open`",
    "posix": "every function that reaches a path, a process or the environment raises an audit event the guard "
    "checks, or is removed by the guard (tests/unit/test_sandbox_extensions.py classifies each)",
    "sys": "interpreter state of the program's own process",
    "time": "clocks and time conversion; the C library reads the system's time-zone file, and the environment "
    "that could name another one cannot be changed",
    # files of lib-dynload
    "_bisect": _PURE,
    "_blake2": _HASH,
    "_bz2": "compression of bytes in memory; `bz2.open` goes through `open`",
    "_codecs_cn": _CODEC,
    "_codecs_hk": _CODEC,
    "_codecs_iso2022": _CODEC,
    "_codecs_jp": _CODEC,
    "_codecs_kr": _CODEC,
    "_codecs_tw": _CODEC,
    "_contextvars": _PURE,
    "_csv": "parses and writes rows through the file objects or iterables it is given",
    "_datetime": "dates and times in memory; local time as `time` reads it",
    "_decimal": _PURE,
    "_elementtree": "XML trees in memory; parsing reads the file objects it is given",
    "_heapq": _PURE,
    "_json": _PURE,
    "_lsprof": "timings of the program's own calls",
    "_lzma": "compression of bytes in memory; `lzma.open` goes through `open`",
    "_md5": _HASH,
    "_multibytecodec": _CODEC,
    "_opcode": _PURE,
    "_pickle": "serialises values in memory; classes are looked up through `import` (audited)",
    "_queue": _PURE,
    "_random": _PURE,
    "_sha1": _HASH,
    "_sha2": _HASH,
    "_sha256": _HASH,
    "_sha3": _HASH,
    "_sha512": _HASH,
    "_statistics": _PURE,
    "_struct": _PURE,
    "_zoneinfo": "time-zone rules; the files are opened through `io.open` (the `open` audit event)",
    "array": "arrays in memory; `fromfile` / `tofile` act on file objects the program opened through `open`",
    "audioop": _PURE,
    "binascii": _PURE,
    "cmath": _PURE,
    "math": _PURE,
    "pyexpat": "an XML parser over bytes it is given; it resolves no external entity itself",
    "resource": "limits of the program's own process; `setrlimit` and `prlimit` raise audit events (prlimit on "
    "another process is refused)",
    "select": "waits on descriptors the program already holds",
    "unicodedata": _PURE,
    "zlib": "compression of bytes in memory",
}

REFUSED = {
    # built into the interpreter
    "faulthandler": "writes tracebacks to any descriptor and crashes the interpreter on purpose; not needed",
    "pwd": "reads the user database (/etc/passwd) through the C library, without an audit event",
    "xxsubtype": _TEST,
    # files of lib-dynload
    "_asyncio": "asyncio's accelerator; asyncio needs sockets, which are refused",
    "_crypt": "crypt(3) through libcrypt; deprecated and not needed",
    "_ctypes": "calls any C function and reads or writes any memory address",
    "_ctypes_test": _TEST,
    "_curses": "terminal control: reads terminfo files and writes windows to files, without audit events",
    "_curses_panel": "terminal control on top of _curses",
    "_dbm": "opens and creates database files at any path, without an audit event",
    "_gdbm": "opens and creates database files at any path, without an audit event",
    "_hashlib": "OpenSSL: reads a configuration file the environment names, which can load further native "
    "modules (hashlib falls back to the built-in hash modules)",
    "_interpchannels": _SUBINTERPRETERS,
    "_interpqueues": _SUBINTERPRETERS,
    "_interpreters": _SUBINTERPRETERS,
    "_multiprocessing": "POSIX semaphores in /dev/shm, without an audit event",
    "_posixshmem": "POSIX shared memory: creates files in /dev/shm, without an audit event",
    "_posixsubprocess": "starts processes without an audit event",
    "_socket": "the network, and local sockets of other processes",
    "_sqlite3": "SQL opens, creates and loads files of its own (ATTACH DATABASE, VACUUM INTO, load_extension) "
    "without an audit event",
    "_ssl": "OpenSSL: reads certificate and key files at any path, without an audit event",
    "_testbuffer": _TEST,
    "_testcapi": _TEST,
    "_testclinic": _TEST,
    "_testclinic_limited": _TEST,
    "_testexternalinspection": _TEST,
    "_testimportmultiple": _TEST,
    "_testinternalcapi": _TEST,
    "_testlimitedcapi": _TEST,
    "_testmultiphase": _TEST,
    "_testsinglephase": _TEST,
    "_tkinter": "a Tcl interpreter, whose `open`, `exec` and `load` commands reach any file or program",
    "_uuid": "libuuid: writes its clock file and talks to the uuidd daemon (uuid falls back to os.urandom)",
    "_xxinterpchannels": _SUBINTERPRETERS,
    "_xxsubinterpreters": _SUBINTERPRETERS,
    "_xxtestfuzz": _TEST,
    "fcntl": "locks and ioctl on descriptors; not needed",
    "grp": "reads the group database (/etc/group) through the C library, without an audit event",
    "mmap": "maps files into memory",
    "nis": "queries NIS servers over the network",
    "ossaudiodev": "opens the sound devices (/dev/dsp, /dev/mixer) without an audit event",
    "readline": "its history functions read and write any file, without an audit event",
    "spwd": "reads the shadow password database",
    "syslog": "writes to the system log socket (/dev/log), without an audit event",
    "termios": "terminal attributes of descriptors; not needed",
    "xxlimited": _TEST,
    "xxlimited_35": _TEST,
}
