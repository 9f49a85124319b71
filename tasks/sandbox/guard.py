"""The Python-level guard of the code sandbox's call processes (see tasks/sandbox/runner.py). Standard
library only: copied into the sandbox beside the harness and imported there as `sandbox_guard`.

An audit hook, which Python code cannot remove, sees every file, process and network operation
of Python code and refuses those that leave the working directory. What it must also withstand:

- the program rewriting what the hook would call: this module's globals (it is in sys.modules),
  builtins, os.path's functions, the hook's own frame reached through a traceback. The hook and
  its helpers therefore read no global name at all: everything they use is a default argument
  bound by install_guard (a tuple, which cannot be changed in place) and is a built-in function
  or an immutable value. Setting or deleting `__code__`, `__defaults__` or `__kwdefaults__` raises
  an audit event, which the hook refuses for its own functions;
- native code, which acts below the hook: only the extension modules of
  tasks/sandbox/extensions.py's ALLOWED can be loaded (the others, files of site-packages and
  files the program writes are refused), and the functions of allowed modules that act without
  an audit event are removed;
- a second thread changing a path between the check and its use: paths are checked as text,
  never by resolving them, and nothing the program controls can make the text name another
  file: it cannot create symlinks, change directory or climb with "..", and the library folders
  it reads through /proc/self/fd are pinned (harness.py's `_pin_library`).
"""

import os
import stat
import sys

_PROCESS_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "pty.spawn",
        "os.startfile",
    }
)
# refused whatever their arguments: a changed directory or a symlink would make a checked path name
# another file; a changed environment would steer the C library (TZ, LOCPATH, OPENSSL_CONF, ...)
_REFUSED_EVENTS = frozenset({"os.chdir", "os.symlink", "os.putenv", "os.unsetenv"})
_WRITE_PATH_EVENTS = frozenset(
    {
        "os.remove",
        "os.rmdir",
        "os.rename",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
        "os.link",
        "shutil.rmtree",
        "shutil.move",
        "shutil.copyfile",
        "shutil.copytree",
        "os.chflags",
        "os.setxattr",
        "os.removexattr",
    }
)
_TWO_PATH_EVENTS = frozenset({"os.rename", "os.link", "shutil.move", "shutil.copyfile", "shutil.copytree"})
_READ_PATH_EVENTS = frozenset({"os.listdir", "os.scandir", "glob.glob", "os.getxattr", "os.listxattr"})
_REFUSED_PREFIXES = ("socket.", "ctypes.", "_ctypes.", "mmap.")
_CODE_ATTRIBUTES = ("__code__", "__defaults__", "__kwdefaults__")
# functions that act without raising an audit event, removed before the program runs
_REMOVED = {
    "posix": (
        "mkfifo",  # files outside the working directory
        "mknod",
        "memfd_create",
        "openpty",  # terminal devices
        "login_tty",
        "pidfd_open",  # other processes
        "setpriority",
        "sched_setaffinity",
        "sched_setparam",
        "sched_setscheduler",
        "setns",  # namespaces (Python 3.12+)
        "unshare",
        "posix_openpt",  # terminal devices (Python 3.13+)
        "grantpt",
        "unlockpt",
        "ptsname",
        "getgrouplist",  # the group and login databases, read by the C library
        "getlogin",
        "fchdir",  # descriptors instead of paths
        "fchmod",
        "fchown",
        "setsid",  # leaving the sandbox's process group
        "setpgid",
        "setpgrp",
    ),
    "_locale": ("gettext", "dgettext", "dcgettext", "textdomain", "bindtextdomain", "bind_textdomain_codeset"),
    "_imp": ("create_builtin",),  # a fresh copy of any built-in module (posix with all of the above)
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_FS_ENCODING = sys.getfilesystemencoding()


def _deny(event, detail, _error=PermissionError):
    raise _error(f"sandbox: {event}{' ' + detail if detail else ''} is not allowed")


_FUNCTION = type(_deny)


def _text(
    event,
    path,
    _type=type,
    _issubclass=issubclass,
    _str=str,
    _bytes=bytes,
    _copy=str.__str__,
    _decode=bytes.decode,
    _encoding=_FS_ENCODING,
    _deny=_deny,
):
    """`path` as an exact str (a copy, so no method of a subclass of the program's runs), or refused.
    Objects with `__fspath__` are refused: the program's method could answer the check and the
    operation differently."""
    kind = _type(path)
    if _issubclass(kind, _str):
        return _copy(path)
    if _issubclass(kind, _bytes):
        return _decode(path, _encoding, "surrogateescape")
    _deny(event, f"with a path of type {kind.__name__} (pass a str)")


def _absolute(event, path, workdir, _list=list, _deny=_deny):
    """The absolute form of `path` (exact str) without "." and repeated "/"; ".." is refused."""
    if not path.startswith("/"):
        path = workdir + "/" + path
    parts = _list()
    for part in path.split("/"):
        if part == "..":
            _deny(event, f"{path!r} (a path may not contain '..')")
        if part and part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


def _under(path, roots):
    for root in roots:
        if path == root or path.startswith(root + "/"):
            return True
    return False


def _is_directory(path, _stat=os.stat, _is_dir=stat.S_ISDIR, _error=OSError):
    try:
        return _is_dir(_stat(path).st_mode)
    except _error:
        return False


def _make_hook(*, workdir, read_roots, extension_files, refused_modules, builtin_modules):
    """The audit hook for a call process whose working directory is `workdir` (absolute, normalised),
    which may also read under `read_roots`, load the extension files `extension_files` ((module
    name, path) pairs) and nothing else native. Separate from install_guard so that tests can call
    it without installing it."""
    own_pid = (0, os.getpid())
    guard_globals = globals()  # compared by identity only: which functions are the guard's

    def hook(
        event,
        args,
        _workdir=(workdir,),
        _read_roots=tuple(read_roots),
        _extension_files=frozenset(extension_files),
        _refused_modules=frozenset(refused_modules),
        _builtin_modules=frozenset(builtin_modules),
        _process_events=_PROCESS_EVENTS,
        _refused_events=_REFUSED_EVENTS,
        _write_events=_WRITE_PATH_EVENTS,
        _two_path_events=_TWO_PATH_EVENTS,
        _read_events=_READ_PATH_EVENTS,
        _refused_prefixes=_REFUSED_PREFIXES,
        _code_attributes=_CODE_ATTRIBUTES,
        _attribute_events=("object.__setattr__", "object.__delattr__"),
        _guard_globals=guard_globals,
        _function=_FUNCTION,
        _write_flags=_WRITE_FLAGS,
        _own_pid=own_pid,
        _deny=_deny,
        _text=_text,
        _absolute=_absolute,
        _under=_under,
        _is_directory=_is_directory,
        _type=type,
        _issubclass=issubclass,
        _int=int,
        _int_value=int.__int__,
        _str=str,
        _import_error=ImportError,
    ):
        if event in _process_events or event in _refused_events:
            _deny(event, "")
        if event.startswith(_refused_prefixes):
            _deny(event, "")
        if event in _attribute_events and args[1] in _code_attributes and _type(args[0]) is _function:
            if args[0].__globals__ is _guard_globals:  # one of the guard's functions
                _deny(event, f"of {args[1]}")
        if event == "resource.prlimit" and _int_value(args[0]) not in _own_pid:
            _deny(event, "on another process")
        if event == "import":
            name = _text(event, args[0])
            if args[2] is not None:  # an import statement (with sys.path): a refused or built-in module
                if name in _refused_modules:
                    raise _import_error(f"sandbox: import of {name!r} is not allowed", name=name)
                if name in _builtin_modules:  # all allowed ones are loaded: this would be a second copy
                    raise _import_error(f"sandbox: import of the built-in module {name!r} again is not allowed")
            elif (name.rpartition(".")[2], _text(event, args[1])) not in _extension_files:  # an extension file
                raise _import_error(
                    f"sandbox: loading the extension module {name!r} from {_text(event, args[1])!r} is not allowed",
                    name=name,
                )
        elif event == "open":
            path, mode, flags = args
            if _issubclass(_type(path), _int):
                return  # a descriptor the program holds
            text_mode = "" if mode is None else _text(event, mode)
            writing = ((flags or 0) & _write_flags) != 0
            for letter in "wax+":
                writing = writing or letter in text_mode
            full = _absolute(event, _text(event, path), _workdir[0])
            if _under(full, _workdir):
                return
            if writing or not _under(full, _read_roots):
                _deny(event, f"{full!r}")
            if _is_directory(full):
                _deny(event, f"{full!r} (a directory outside the working directory)")
        elif event in _write_events and args:
            paths = (args[0], args[1]) if event in _two_path_events else (args[0],)
            for path in paths:
                if _issubclass(_type(path), _int):
                    _deny(event, "on a descriptor")
                full = _absolute(event, _text(event, path), _workdir[0])
                if not _under(full, _workdir):
                    _deny(event, f"{full!r}")
        elif event in _read_events and args:
            path = "." if args[0] is None else args[0]
            if not _issubclass(_type(path), _int):
                full = _absolute(event, _text(event, path), _workdir[0])
                if not (_under(full, _workdir) or _under(full, _read_roots)):
                    _deny(event, f"{full!r}")

    return hook


def _loaded_extensions(builtin_modules, suffixes):
    found = set()
    for name, module in list(sys.modules.items()):
        origin = str(getattr(module, "__file__", None) or "")
        if name in builtin_modules or origin.endswith(suffixes):
            found.add(name)
    return found


def prepare_guard(*, workdir, read_roots, allowed):
    """What install_guard reads from the file system, read once where the processes that install it
    are forked from (the zygote): the files of the extension modules named in `allowed` in the
    folders of `read_roots`, and the absolute forms of `workdir` and `read_roots`. Also loads the
    allowed built-in modules (once the guard is installed, no built-in module can be created)."""
    import _imp

    builtin_modules = frozenset(sys.builtin_module_names)
    for name in sorted(builtin_modules & set(allowed)):
        __import__(name)
    suffixes = tuple(_imp.extension_suffixes())
    folders = [p.rstrip("/") for p in read_roots if os.path.isdir(p)]
    folders += [os.path.realpath(p) for p in folders]
    extension_files = set()
    for folder in folders:
        for name in allowed:
            for suffix in suffixes:
                if os.path.isfile(f"{folder}/{name}{suffix}"):
                    extension_files.add((name, f"{folder}/{name}{suffix}"))
    return {
        "workdir": os.path.realpath(workdir),
        "read_roots": sorted({os.path.normpath(p) for p in read_roots} | {os.path.realpath(p) for p in read_roots}),
        "extension_files": frozenset(extension_files),
        "allowed": frozenset(allowed),
    }


def install_guard(prepared, *, refused):
    """Install the guard in this process (a call process, before it reads its request) with what
    prepare_guard read: writes only under its `workdir`, reads also under its `read_roots` (the
    standard library's folders: never a directory there, though), no process creation, signals,
    sockets, ctypes, limits on other processes, symlinks, directory changes or environment changes,
    and of native modules only the extension modules it allows. `refused` names modules refused
    with a plain ImportError at the import statement. Fails when an extension module outside the
    allowed ones is loaded (the process was forked from one that loaded it)."""
    import _imp

    builtin_modules = frozenset(sys.builtin_module_names)
    suffixes = tuple(_imp.extension_suffixes())
    unexpected = sorted(_loaded_extensions(builtin_modules, suffixes) - prepared["allowed"])
    if unexpected:
        raise RuntimeError(f"sandbox: extension modules loaded before the guard are not allowed: {unexpected}")
    for module_name, names in _REMOVED.items():
        module = sys.modules[module_name]
        for name in names:
            function = module.__dict__.pop(name, None)
            if module_name == "posix":
                os.__dict__.pop(name, None)
                for group in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks):
                    group.discard(function)
    hook = _make_hook(
        workdir=prepared["workdir"],
        read_roots=prepared["read_roots"],
        extension_files=prepared["extension_files"],
        refused_modules=refused,
        builtin_modules=builtin_modules,
    )
    sys.addaudithook(hook)
