"""What the sandboxed interpreter runs before the untrusted code: ``PREAMBLE`` sets the
resource limits, installs the audit hook that refuses sockets, subprocesses and writes
outside the run directory, then runs the code (script mode) or calls one function on JSON
inputs (function mode), and reports limits by its exit code."""

from __future__ import annotations

# exit codes the preamble uses to report why it stopped
CPU_EXIT = 86
MEMORY_EXIT = 87
SETUP_EXIT = 88
LIMIT_EXIT = 89

# The program the sandboxed interpreter runs first (python -c PREAMBLE CONFIG_JSON). It sets
# the limits, installs the audit hook, then runs main.py (script mode) or main.py plus the
# calls of one function on JSON inputs read from stdin (function mode). Python 3.8 syntax.
PREAMBLE = r"""
import errno, json, os, resource, signal, sys, threading, traceback, types

cfg = json.loads(sys.argv[1])

def _fail(msg, code):
    os.write(2, ("sandbox: " + msg + "\n").encode())
    os._exit(code)

def _uid_tasks():
    # without a user namespace RLIMIT_NPROC counts every task of the real uid
    uid, n = str(os.getuid()), 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/status" % name) as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except (OSError, ValueError):
            continue
        if fields.get("Uid", "").split()[:1] == [uid]:
            n += int(fields.get("Threads", "1"))
    return n

def _limit(which, soft, hard=None):
    hard = soft if hard is None else hard
    cur_soft, cur_hard = resource.getrlimit(which)
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    try:
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError) as e:
        _fail("cannot set limit %r: %s" % (which, e), cfg["setup_exit"])

signal.signal(signal.SIGXCPU, lambda *_: _fail("cpu time limit", cfg["cpu_exit"]))
_limit(resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)
_limit(resource.RLIMIT_AS, cfg["mem"])
_limit(resource.RLIMIT_FSIZE, cfg["fsize"])
_limit(resource.RLIMIT_NOFILE, cfg["nofile"])
_limit(resource.RLIMIT_CORE, 0)
# the unshare process is the one other task of the user namespace
_limit(resource.RLIMIT_NPROC,
       cfg["procs"] + (1 if cfg["procs_base"] == "userns" else _uid_tasks() - 1))

ROOT = os.path.realpath(cfg["root"])
with open(cfg["main"], encoding="utf-8") as fh:
    SOURCE = fh.read()
INPUTS = json.loads(sys.stdin.read() or "[]") if cfg["mode"] == "function" else None
if INPUTS is not None:
    sys.stdin = open(os.devnull)
OUT = os.dup(1)

BLOCKED_EVENTS = {
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.startfile", "subprocess.Popen", "pty.spawn", "_posixsubprocess.fork_exec",
    "resource.setrlimit", "resource.prlimit", "sys.remote_exec",
}
BLOCKED_PREFIXES = ("socket.", "ctypes.", "_ctypes.")
BLOCKED_MODULES = {
    "socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess",
    "multiprocessing", "_multiprocessing", "ctypes", "_ctypes", "pty",
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
PATH_EVENTS = {  # event -> [(index of a path argument, index of its dir_fd or None)]
    "os.remove": [(0, 1)], "os.rmdir": [(0, 1)], "os.mkdir": [(0, 2)],
    "os.rename": [(0, 2), (1, 3)], "os.link": [(0, 2), (1, 3)], "os.symlink": [(1, 2)],
    "os.chmod": [(0, 2)], "os.chown": [(0, 3)], "os.utime": [(0, 3)],
    "os.truncate": [(0, None)], "os.chflags": [(0, None)], "os.lchflags": [(0, None)],
    "os.setxattr": [(0, None)], "os.removexattr": [(0, None)],
}
_busy = []

def _fd_path(fd):
    return os.readlink("/proc/self/fd/%d" % fd)

def _inside(path, dir_fd=None, strict_relative=False):
    if isinstance(path, int):
        try:
            path = _fd_path(path)
        except OSError:
            return False
    path = os.fsdecode(path)
    if not os.path.isabs(path):
        if strict_relative:
            return False
        base = _fd_path(dir_fd) if isinstance(dir_fd, int) and dir_fd >= 0 else os.getcwd()
        path = os.path.join(base, path)
    for p in (os.path.realpath(path),
              os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))):
        if p != "/dev/null" and p != ROOT and not p.startswith(ROOT + os.sep):
            return False
    return True

_forked = [False]
os.register_at_fork(before=lambda: _forked.__setitem__(0, True))

def _no_room_for_a_stack():
    # pthread_create fails with EAGAIN both when the stack mmap hits RLIMIT_AS and when
    # clone hits RLIMIT_NPROC: the address space left tells them apart
    size = threading.stack_size() or resource.getrlimit(resource.RLIMIT_STACK)[0]
    if size <= 0 or size == resource.RLIM_INFINITY:
        size = 32 << 20
    try:
        with open("/proc/self/status") as fh:
            vm = [int(l.split()[1]) << 10 for l in fh if l.startswith("VmSize:")][0]
    except (OSError, IndexError, ValueError):
        return False
    return vm + size + (1 << 20) > cfg["mem"]

def _limit_kind(e):
    if isinstance(e, MemoryError):
        return "memory"
    if isinstance(e, RuntimeError) and "can't start new thread" in str(e):
        return "memory" if _no_room_for_a_stack() else "process"
    if isinstance(e, BlockingIOError) and e.errno == errno.EAGAIN and _forked[0]:
        return "process"
    return None

def _stop_if_limit(e):
    kind = _limit_kind(e)
    if kind == "process":
        _fail("process limit: " + _short(e), cfg["limit_exit"])
    if kind == "memory":
        what = "" if isinstance(e, MemoryError) else " (no room for a thread stack)"
        _fail("MemoryError" + what, cfg["memory_exit"])

def _thread_hook(args, _default=threading.excepthook):
    _stop_if_limit(args.exc_value)
    _default(args)

def _unraisable_hook(u, _default=sys.unraisablehook):
    _stop_if_limit(u.exc_value)
    _default(u)

# a thread that cannot start a thread (or allocate) ends the run, as the main thread does
threading.excepthook = _thread_hook
sys.unraisablehook = _unraisable_hook

def _deny(event):
    raise PermissionError("sandbox: %s is not allowed" % event)

def _hook(event, args):
    if _busy:
        return
    _busy.append(1)
    try:
        if event in BLOCKED_EVENTS or event.startswith(BLOCKED_PREFIXES):
            _deny(event)
        if event == "import":
            name = str(args[0])
            if name in BLOCKED_MODULES or name.split(".")[0] in BLOCKED_MODULES:
                _deny("import of " + name)
        elif event == "open":
            path, mode, flags = args
            if isinstance(mode, str):
                writing = any(c in mode for c in "wax+")
            else:
                writing = bool(int(flags or 0) & WRITE_FLAGS)
            # os.open does not report its dir_fd: only absolute paths may be written by it
            if writing and not _inside(path, strict_relative=mode is None):
                _deny("writing %r" % (path,))
        elif event in ("os.kill", "os.killpg"):
            if args[0] not in (0, os.getpid()):
                _deny(event)
        elif event in PATH_EVENTS:
            for i, j in PATH_EVENTS[event]:
                dir_fd = args[j] if j is not None and j < len(args) else None
                if i < len(args) and not _inside(args[i], dir_fd):
                    _deny("%s on %r" % (event, args[i]))
    finally:
        _busy.pop()

try:
    CODE = compile(SOURCE, "main.py", "exec")
except MemoryError:
    _fail("MemoryError", cfg["memory_exit"])
except (SyntaxError, ValueError) as e:
    traceback.print_exception(type(e), e, None)
    sys.exit(1)

if cfg["audit"]:
    sys.addaudithook(_hook)

main = types.ModuleType("__main__")
main.__file__ = "main.py"
main.__builtins__ = __builtins__
sys.modules["__main__"] = main
sys.argv = ["main.py"]

def _emit(record):
    data = ("\n" + cfg["nonce"] + " " + record + "\n").encode()
    while data:
        data = data[os.write(OUT, data):]

def _short(e):
    return ("%s: %s" % (type(e).__name__, e))[:300]

try:
    exec(CODE, main.__dict__)
    if INPUTS is not None:
        fn = main.__dict__.get(cfg["func"])
        if not callable(fn):
            _emit(json.dumps(["missing", cfg["func"]]))
            sys.exit(1)
        for i, args in enumerate(INPUTS):
            try:
                value = fn(*args)
            except BaseException as e:
                if _limit_kind(e):
                    raise
                _emit(json.dumps([i, "error", _short(e)]))
                continue
            try:
                text = json.dumps(value)
            except (TypeError, ValueError):
                _emit(json.dumps([i, "unserializable", repr(value)[:300]]))
                continue
            _emit('[%d, "ok", %s]' % (i, text))
except MemoryError:
    _fail("MemoryError", cfg["memory_exit"])
except SystemExit:
    raise
except BaseException as e:
    _stop_if_limit(e)
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    traceback.print_exception(type(e), e, tb)
    sys.exit(1)
"""
