"""The sandbox's fork server: a small single-threaded process that forks one child per job.

Run by `cohortrl.grading.sandbox.Sandbox` as ``python -I -S sandbox_server.py CONFIG_JSON`` (a fresh
interpreter, standard library only: never torch, never the trainer's threads, so forking it is safe).
It talks JSON lines over its stdin/stdout: requests ``{"id", "code", "func", "calls", "timeout_s",
"memory_mb"}`` in, ``{"id", "result": {...}}`` out, after one ``{"hello": {...}}`` that says which
protections this machine actually gives. Nothing a child writes can reach that channel, and nothing it
writes is trusted: its result is parsed and checked (`check_result`), so no output of a job, and no way
for it to die, takes the server down.

Each job's child, before any model text is even compiled:
  1. leads its own process group (the server kills the whole group at the wall-clock limit) and dies
     with the server (PR_SET_PDEATHSIG);
  2. has stdin on /dev/null, stdout and stderr on one capped pipe to the server, its result pipe on fd 3,
     and every other descriptor closed;
  3. works in an empty directory of its own (one per child slot, emptied after every job); when the
     server is root, that directory is also the child's root (chroot), so it sees no other file at all;
  4. as root, becomes a uid of its own with no groups (so it can signal or read nothing of anyone else's,
     and RLIMIT_NPROC applies);
  5. gets rlimits: CPU seconds, address space, 8 open files, 0 new processes, file size 0, no core;
  6. loads a seccomp allow-list where libseccomp and the kernel allow: a few dozen system calls a pure
     computation needs; process creation, exec, sockets, signals and ptrace kill the child (SIGSYS);
     anything else (open, unlink, mkdir, ...) fails with EPERM.
The server itself moves into a network namespace of its own at start (no interfaces up), so no child
has a network even where seccomp is unavailable.

Scheduling: jobs start in arrival order while fewer than ``max_workers`` children are younger than
``fast_s``; a child older than that is re-niced to 19 and stops holding its slot, so a batch of CPU-hogging
or sleeping jobs cannot hold back the honest ones (most finish in a few milliseconds) beyond ``fast_s``
each. ``max_children`` bounds the live children, and so the memory a batch can take.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import resource
import selectors
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import deque

# Modules the model's code may import. They are imported here, once, so that an import in a child is a
# dictionary look-up: after the seccomp filter a child can open no file, so it could load nothing new.
ALLOWED_MODULES = (
    "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal", "enum", "fractions",
    "functools", "heapq", "itertools", "json", "math", "numbers", "operator", "random", "re", "statistics",
    "string", "time", "typing",
)
for _name in ALLOWED_MODULES:
    __import__(_name)
import collections.abc  # noqa: E402,F401  (a submodule the model may name)

# Builtins that touch the outside world or the terminal. Removing them is not the security boundary (the
# child process is: `().__class__.__base__.__subclasses__()` reaches them anyway); it makes the common
# cases fail with a clear NameError instead of a permission error from deep inside.
REMOVED_BUILTINS = ("open", "input", "breakpoint", "help", "exit", "quit", "copyright", "credits", "license")

# --------------------------------------------------------------------------------------------------------
# seccomp through libseccomp (Debian's libseccomp2), called with ctypes: the server runs with -I -S, so it
# sees no site-packages, and a Python binding would add nothing but a dependency.

SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO_EPERM = 0x00050000 | errno.EPERM
SCMP_CMP_EQ = 4
SCMP_CMP_MASKED_EQ = 7
AT_EMPTY_PATH = 0x1000
# fcntl only to read and set descriptor and status flags (F_GETFD, F_SETFD, F_GETFL, F_SETFL). F_SETOWN and
# F_SETSIG would let a job have the kernel signal a process of its choice when a pipe is read: itself, with
# a real-time signal (the server used to die naming it), or, where jobs share the server's uid, the server.
FCNTL_COMMANDS = (1, 2, 3, 4)

# What a pure computation needs once its interpreter is up: memory, reading and writing the descriptors
# it already holds, time, sleeping, signal masks, random numbers, and exiting.
ALLOWED_SYSCALLS = (
    "read", "write", "readv", "writev", "pread64", "lseek", "close", "fstat",
    "mmap", "munmap", "mremap", "mprotect", "brk", "madvise",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "restart_syscall",
    "futex", "sched_yield", "getpid", "gettid", "getppid", "getuid", "geteuid", "getgid", "getegid",
    "getcwd", "uname", "sysinfo", "getrusage", "times",
    "clock_gettime", "clock_getres", "gettimeofday", "time", "nanosleep", "clock_nanosleep",
    "select", "pselect6", "poll", "ppoll", "getrandom", "exit", "exit_group",
)
# Killed outright rather than refused, so code that ignores errors (os.system returns -1) cannot carry on,
# and the reason is unambiguous: process creation, exec, the network, signals, tracing, namespaces.
KILLED_SYSCALLS = (
    "fork", "vfork", "clone", "clone3", "execve", "execveat",
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4", "sendto", "sendmsg",
    "sendmmsg", "recvfrom", "recvmsg", "recvmmsg",
    "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open", "pidfd_send_signal",
    "ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "mount", "bpf",
    "perf_event_open", "io_uring_setup",
)


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class Seccomp:
    """The filter, built once in the server; each child only loads it. ``error`` says why it is off."""

    def __init__(self) -> None:
        self.ctx = None
        self.error = ""
        try:
            lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
        except OSError as e:
            self.error = f"libseccomp.so.2 not found ({e}); install Debian's libseccomp2"
            return
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(ArgCmp)]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        self.lib = lib
        ctx = lib.seccomp_init(SCMP_ACT_ERRNO_EPERM)
        if not ctx:
            self.error = "seccomp_init failed"
            return
        for names, action in ((ALLOWED_SYSCALLS, SCMP_ACT_ALLOW), (KILLED_SYSCALLS, SCMP_ACT_KILL_PROCESS)):
            for name in names:
                number = lib.seccomp_syscall_resolve_name(name.encode())
                if number < 0:
                    continue  # not a system call on this architecture
                if lib.seccomp_rule_add_array(ctx, action, number, 0, None) != 0:
                    self.error = f"seccomp_rule_add({name}) failed"
                    return
        # glibc's fstat() is newfstatat(fd, "", buf, AT_EMPTY_PATH); stat() of a path stays refused.
        rules = [(b"newfstatat", ArgCmp(3, SCMP_CMP_MASKED_EQ, AT_EMPTY_PATH, AT_EMPTY_PATH))]
        rules += [(name, ArgCmp(1, SCMP_CMP_EQ, cmd, 0)) for name in (b"fcntl", b"fcntl64") for cmd in FCNTL_COMMANDS]
        for name, rule in rules:
            number = lib.seccomp_syscall_resolve_name(name)
            if number >= 0 and lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, number, 1, ctypes.byref(rule)) != 0:
                self.error = f"seccomp_rule_add({name.decode()}) failed"
                return
        self.ctx = ctx

    def load(self) -> bool:
        return self.ctx is not None and self.lib.seccomp_load(self.ctx) == 0

    def probe(self) -> None:
        """Prove the kernel enforces the filter: a probe child that loads it and opens a socket must die
        of SIGSYS. Anything else turns seccomp off, with the reason in ``error``."""
        if self.ctx is None:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        pid = os.fork()
        if pid == 0:
            try:
                if self.load():
                    libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS):
            self.ctx = None
            self.error = "the kernel did not enforce the seccomp filter (no SECCOMP_MODE_FILTER?)"


# --------------------------------------------------------------------------------------------------------
# Network namespace for the server (and so every child).

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


def isolate_network() -> str:
    """Enter an empty network namespace; returns what happened, for the hello message."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return "network namespace (no interfaces up)"
    first = os.strerror(ctypes.get_errno())
    # Without CAP_SYS_ADMIN, a user namespace that maps our own uid and gid gives it, if the kernel allows
    # unprivileged user namespaces.
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        try:
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                with open(path, "w") as f:
                    f.write(text)
            return "user and network namespace (no interfaces up)"
        except OSError as e:
            return f"none: uid map failed ({e})"
    return f"none: unshare failed ({first}; user namespaces: {os.strerror(ctypes.get_errno())})"


# --------------------------------------------------------------------------------------------------------
# The child: everything below runs after fork, in the job's own process.

UID_BASE = 1_500_000  # each child slot gets uid UID_BASE + slot when the server is root
RESULT_FD = 3
MAX_RESULT_BYTES = 1 << 20
MAX_VALUE_DEPTH = 20  # nesting of a returned value
MAX_INT = 10**300  # a larger returned integer is refused (JSON readers elsewhere may not take it)
MAX_ERROR_CHARS = 1000  # an exception's message is cut to this: it is feedback, not data
SECCOMP_FAILED = 73  # a child's exit code when its filter would not load


def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level:
        raise ImportError("relative imports are not available in the sandbox")
    top = name.partition(".")[0]
    if top not in ALLOWED_MODULES or name not in sys.modules:
        raise ImportError(f"import of {name!r} is not allowed in the sandbox (allowed: {', '.join(ALLOWED_MODULES)})")
    return sys.modules[name] if fromlist else sys.modules[top]


def restricted_builtins() -> dict:
    import builtins

    allowed = {k: v for k, v in vars(builtins).items() if k not in REMOVED_BUILTINS}
    allowed["__import__"] = guarded_import
    return allowed


def as_json(value, depth=0):
    """The returned value as plain JSON data of exact types: tuples become lists, and a subclass of int,
    float, str, list, tuple or dict is read through the base type's own methods, so none of its overrides
    (``__abs__``, ``__iter__``, ``__eq__``, ...) runs and the client compares plain values. Anything else
    non-JSON is an error. (Not a security boundary: the model's code can write its own result on the
    result pipe, which is why the server checks what it reads, `check_result`.)"""
    if depth > MAX_VALUE_DEPTH:
        raise TypeError(f"returned data nested more than {MAX_VALUE_DEPTH} levels deep")
    if value is None or type(value) is bool:
        return value
    if isinstance(value, int):
        value = int.__int__(value)
        if abs(value) > MAX_INT:
            raise TypeError("returned an integer too large to report")
        return value
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (list, tuple)):
        items = list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value)
        return [as_json(v, depth + 1) for v in items]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in dict.keys(value)):
            raise TypeError("returned a dict whose keys are not all strings")
        return {str.__str__(k): as_json(v, depth + 1) for k, v in dict.items(value)}
    raise TypeError(f"returned a {type(value).__name__}, which is not plain data (numbers, strings, lists)")


def describe(error: BaseException, memory_mb: int) -> str:
    """One line: the exception and the line of the model's code it came from."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()[-1]
    if len(text) > MAX_ERROR_CHARS:
        text = f"{text[:MAX_ERROR_CHARS]}… ({len(text) - MAX_ERROR_CHARS} more characters)"
    if isinstance(error, MemoryError):
        text = f"MemoryError: the memory limit of {memory_mb} MB was exceeded"
    # walk_tb rather than extract_tb: looking up source lines would try to open files, which fails here.
    lines = [n for frame, n in traceback.walk_tb(error.__traceback__) if frame.f_code.co_filename == "<solution>"]
    return f"{text} (line {lines[-1]})" if lines else text


def cpu_limit(timeout_s: float) -> int:
    """RLIMIT_CPU's soft limit for a job: the first whole second above its wall-clock limit. The wall-clock
    limit is the contract (the server kills at it); this is the backstop should the server not. Not equal to it:
    the kernel samples CPU time in scheduler ticks and can count a busy job a tick ahead, so a CPU limit of
    exactly the wall-clock limit ended 1 s jobs up to a few milliseconds early."""
    return math.floor(timeout_s) + 1


def run_job(job: dict) -> dict:
    """Compile the model's code, find its function and call it once per argument list."""
    namespace = {"__builtins__": restricted_builtins(), "__name__": "solution"}
    memory_mb = job["memory_mb"]
    try:
        exec(compile(job["code"], "<solution>", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001  (SystemExit and KeyboardInterrupt are the model's too)
        return {"error": f"the code failed before any call: {describe(e, memory_mb)}"}
    func = namespace.get(job["func"])
    if not callable(func):
        return {"error": f"the code defines no function {job['func']!r}"}
    calls = []
    for args in job["calls"]:
        try:
            calls.append({"ok": True, "value": as_json(func(*args))})
        except BaseException as e:  # noqa: BLE001
            calls.append({"ok": False, "error": describe(e, memory_mb)})
    return {"calls": calls}


def child_main(job: dict, fds: dict, slot: int, seccomp: Seccomp, server_pid: int) -> None:
    """Runs in the forked child and never returns."""
    code = 70
    try:
        os.setpgid(0, 0)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
        if os.getppid() != server_pid:
            os._exit(71)  # the server died before the line above: nobody would ever reap this child
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(fds["null"], 0)
        os.dup2(fds["out"], 1)
        os.dup2(fds["out"], 2)
        os.dup2(fds["result"], RESULT_FD)
        os.closerange(RESULT_FD + 1, 1 << 16)
        os.chdir(job["dir"])
        if os.geteuid() == 0:
            os.chroot(".")  # what was opened before (/dev/null, the pipes, libseccomp) stays usable
            os.chdir("/")
            uid = UID_BASE + slot
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        cpu = cpu_limit(job["timeout_s"])
        limits = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, job["as_bytes"], job["as_bytes"]),
                  (resource.RLIMIT_NOFILE, 8, 8), (resource.RLIMIT_NPROC, 0, 0), (resource.RLIMIT_FSIZE, 0, 0),
                  (resource.RLIMIT_CORE, 0, 0)]
        for which, soft, hard in limits:
            resource.setrlimit(which, (soft, hard))
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)
        sys.stderr = sys.stdout
        filtered = seccomp.load()
        if seccomp.ctx is not None and not filtered:
            os._exit(SECCOMP_FAILED)  # fail closed: never run model code unfiltered where a filter is due
        result = run_job(job)
        result["seccomp"] = filtered
        sys.stdout.flush()
        data = json.dumps(result).encode()
        if len(data) > MAX_RESULT_BYTES:
            data = json.dumps({"error": f"the result is larger than {MAX_RESULT_BYTES} bytes", "seccomp": filtered}).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(RESULT_FD, view):]
        code = 0
    except BaseException:  # noqa: BLE001  (a failure of the set-up itself: the server reports the exit code)
        code = 72
    os._exit(code)


# --------------------------------------------------------------------------------------------------------
# The server: a select loop over the request pipe, the children's pipes and a SIGCHLD wake-up pipe.


class Child:
    def __init__(self, job: dict, pid: int, slot: int, out_fd: int, result_fd: int, started: float) -> None:
        self.job, self.pid, self.slot, self.started = job, pid, slot, started
        self.fds = {out_fd: "out", result_fd: "result"}
        self.out, self.result = bytearray(), bytearray()
        self.status: int | None = None  # from waitpid, once reaped
        self.killed_for = ""  # set when the server kills it (timeout, output)
        self.fast = True  # still holding one of the max_workers start slots

    @property
    def deadline(self) -> float:
        return self.started + self.job["timeout_s"]


SIGNAL_REASONS = {
    signal.SIGSYS: "a forbidden system call (process creation, exec, network, signals or ptrace): killed by the seccomp filter",
    signal.SIGXCPU: "timeout: the CPU-time limit of {cpu} s was exceeded",
    signal.SIGSEGV: "crashed (SIGSEGV): e.g. the C stack overflowed in deep recursion",
    signal.SIGXFSZ: "tried to write a file (file size limit 0)",
}


def signal_name(sig: int) -> str:
    """SIGTERM, SIGRTMIN+6, or "signal 99": any number a wait status can hold (real-time signals have no
    member in `signal.Signals`, whose constructor raises for them)."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        if signal.SIGRTMIN <= sig <= signal.SIGRTMAX:
            return f"SIGRTMIN+{sig - signal.SIGRTMIN}"
        return f"signal {sig}"


def plain_value(value, depth: int = 0) -> bool:
    """Is ``value`` (parsed from a child's JSON) plain data that `as_json` could have produced? Bounded by
    ``MAX_VALUE_DEPTH``, so a forged value nested a thousand deep is refused without deep recursion."""
    if value is None or type(value) in (bool, float, str):
        return True
    if type(value) is int:
        return abs(value) <= MAX_INT
    if depth >= MAX_VALUE_DEPTH:
        return False
    if type(value) is list:
        return all(plain_value(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(plain_value(v, depth + 1) for v in value.values())
    return False


def check_result(raw: bytes, n_calls: int) -> tuple[dict | None, str]:
    """A child's result bytes as ``({"calls": [...]} or {"error": text}, "")``, or ``(None, why not)``.

    The bytes are untrusted: the model's code can write anything on the result pipe. Only what `run_job`
    writes passes: ``n_calls`` objects, each ``{"ok": true, "value": plain data}`` or ``{"ok": false,
    "error": text}``, or one ``{"error": text}``; any parse failure (RecursionError for deep nesting
    included) is a reason, never an exception."""
    try:
        data = json.loads(raw)
    except Exception as e:  # noqa: BLE001  (ValueError, RecursionError, MemoryError: all the job's doing)
        return None, f"its result is not valid JSON ({type(e).__name__})"
    if not isinstance(data, dict):
        return None, "its result is not a JSON object"
    if "error" in data:
        if type(data["error"]) is not str:
            return None, "its result's error is not text"
        return {"error": data["error"][: MAX_ERROR_CHARS + 200], "seccomp": data.get("seccomp") is True}, ""
    calls = data.get("calls")
    if type(calls) is not list or len(calls) != n_calls:
        return None, f"its result does not hold one entry per call ({n_calls})"
    clean = []
    for i, call in enumerate(calls):
        if type(call) is not dict or type(call.get("ok")) is not bool:
            return None, f"its result for call {i + 1} is not an object with a boolean 'ok'"
        if call["ok"] and not plain_value(call.get("value")):
            return None, (f"its result for call {i + 1} is not plain data (numbers up to 1e300 in size, text, lists and "
                          f"objects nested at most {MAX_VALUE_DEPTH} deep)")
        if not call["ok"] and type(call.get("error")) is not str:
            return None, f"its result for call {i + 1} has no error text"
        clean.append({"ok": True, "value": call.get("value")} if call["ok"]
                     else {"ok": False, "error": call["error"][: MAX_ERROR_CHARS + 200]})
    return {"calls": clean, "seccomp": data.get("seccomp") is True}, ""


class Server:
    def __init__(self, config: dict) -> None:
        self.max_workers = config["max_workers"]
        self.max_children = config["max_children"]
        self.fast_s = config["fast_s"]
        self.output_limit = config["output_limit"]
        self.network = isolate_network()
        self.seccomp = Seccomp()
        self.seccomp.probe()
        if not config.get("seccomp", True) and self.seccomp.ctx is not None:
            self.seccomp.ctx, self.seccomp.error = None, "turned off by the caller (Sandbox(seccomp=False))"
        self.root = os.geteuid() == 0
        self.base_dir = tempfile.mkdtemp(prefix="cohortrl-sandbox-")
        os.chmod(self.base_dir, 0o711)
        # One working directory per child slot, emptied after every job: as fresh as a new one, without
        # the milliseconds that creating and removing a directory per job costs on some filesystems.
        self.slot_dirs = [self.make_slot_dir(slot) for slot in range(self.max_children)]
        self.null_fd = os.open(os.devnull, os.O_RDWR)
        self.queue: deque[dict] = deque()
        self.children: dict[int, Child] = {}  # by pid
        self.by_fd: dict[int, Child] = {}
        self.free_slots = list(range(self.max_children))
        self.inbox = bytearray()
        self.selector = selectors.DefaultSelector()
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(0, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)

    def hello(self) -> dict:
        limits = ["RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NOFILE=8", "RLIMIT_NPROC=0", "RLIMIT_FSIZE=0", "RLIMIT_CORE=0"]
        return {"pid": os.getpid(), "seccomp": self.seccomp.ctx is not None, "seccomp_error": self.seccomp.error,
                "network": self.network, "own_uid_per_job": self.root, "chroot": self.root, "rlimits": limits,
                "python": sys.version.split()[0]}

    def send(self, message: dict) -> None:
        view = memoryview((json.dumps(message) + "\n").encode())  # ensure_ascii: lone surrogates are escaped
        while view:
            view = view[os.write(1, view):]

    # -- the loop ---------------------------------------------------------------------------------------
    def serve(self) -> None:
        self.send({"hello": self.hello()})
        try:
            while True:
                timeout = self.next_timer()
                for key, _ in self.selector.select(timeout):
                    if key.fd == 0:
                        if not self.read_requests():
                            return
                    elif key.fd == self.wake_r:
                        self.drain_wakeups()
                    else:
                        self.read_child(key.fd)
                self.reap()
                self.enforce_timers()
                self.start_jobs()
        finally:
            for child in self.children.values():
                self.kill(child, "the sandbox server stopped")
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def next_timer(self) -> float | None:
        times = [c.deadline for c in self.children.values() if c.status is None]
        times += [c.started + self.fast_s for c in self.children.values() if c.fast]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def read_requests(self) -> bool:
        data = os.read(0, 1 << 20)
        if not data:
            return False  # the client went away: stop, and take every child with us
        self.inbox += data
        while (end := self.inbox.find(b"\n")) >= 0:
            line, self.inbox = bytes(self.inbox[:end]), self.inbox[end + 1:]
            try:
                job = json.loads(line)
                job["as_bytes"] = job["memory_mb"] << 20
                job["received"] = time.monotonic()
                self.queue.append(job)
            except Exception as e:  # noqa: BLE001  (a bad request fails alone; the server carries on)
                self.send({"id": None, "error": f"bad request: {type(e).__name__}: {str(e)[:200]}"})
        return True

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def read_child(self, fd: int) -> bool:
        """Read what one child pipe holds; False once there is nothing more to read for now."""
        child = self.by_fd[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not data:
            self.close_fd(child, fd)
            return False
        if child.fds[fd] == "out":
            room = self.output_limit - len(child.out)
            child.out += data[:room]
            if len(data) > room and not child.killed_for:
                self.kill(child, f"output too large: more than {self.output_limit} bytes on stdout/stderr")
        else:
            child.result += data
            if len(child.result) > MAX_RESULT_BYTES + 4096 and not child.killed_for:
                self.kill(child, f"result too large: more than {MAX_RESULT_BYTES} bytes")
        return True

    def close_fd(self, child: Child, fd: int) -> None:
        self.selector.unregister(fd)
        os.close(fd)
        del self.by_fd[fd]
        del child.fds[fd]

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.children:
                child = self.children[pid]
                child.status = status
                # Nothing else holds the pipes (children cannot fork), so what is left is already in them.
                for fd in list(child.fds):
                    while self.read_child(fd):
                        pass
                    if fd in child.fds:
                        self.close_fd(child, fd)
                self.finish(child)

    def enforce_timers(self) -> None:
        now = time.monotonic()
        for child in list(self.children.values()):
            if child.status is None and now >= child.deadline and not child.killed_for:
                self.kill(child, f"timeout: ran longer than the wall-clock limit of {child.job['timeout_s']:g} s")
            if child.fast and now >= child.started + self.fast_s:
                child.fast = False
                try:
                    os.setpriority(os.PRIO_PROCESS, child.pid, 19)
                except OSError:
                    pass  # already gone

    def kill(self, child: Child, reason: str) -> None:
        child.killed_for = child.killed_for or reason
        if child.status is not None:
            return  # already reaped: its pid may belong to someone else by now
        try:
            # Back to normal priority first: a re-niced child among CPU hogs could otherwise wait long
            # for the CPU time it needs to exit (a root server may raise priority; others cannot).
            os.setpriority(os.PRIO_PROCESS, child.pid, 0)
        except OSError:
            pass
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:
            pass

    def start_jobs(self) -> None:
        while self.queue and self.free_slots and sum(c.fast for c in self.children.values()) < self.max_workers:
            self.start(self.queue.popleft())

    def start(self, job: dict) -> None:
        slot = self.free_slots.pop()
        job["dir"] = self.slot_dirs[slot]
        job["as_bytes"] += self.address_space_in_use()
        out_r, out_w = os.pipe()
        result_r, result_w = os.pipe()
        server_pid = os.getpid()
        try:
            pid = os.fork()
        except OSError as e:  # out of memory or processes: this job fails, the server carries on
            for fd in (out_r, out_w, result_r, result_w):
                os.close(fd)
            self.free_slots.append(slot)
            self.send({"id": job["id"], "result": {"ok": False, "reason": f"the sandbox could not start the job ({e})",
                                                   "seccomp": self.seccomp.ctx is not None}})
            return
        if pid == 0:
            child_main(job, {"null": self.null_fd, "out": out_w, "result": result_w}, slot, self.seccomp, server_pid)
        try:
            os.setpgid(pid, pid)  # also here, so a kill right after fork already reaches the group
        except OSError:
            pass
        os.close(out_w)
        os.close(result_w)
        child = Child(job, pid, slot, out_r, result_r, time.monotonic())
        self.children[pid] = child
        for fd in (out_r, result_r):
            os.set_blocking(fd, False)
            self.by_fd[fd] = child
            self.selector.register(fd, selectors.EVENT_READ)

    def make_slot_dir(self, slot: int) -> str:
        path = os.path.join(self.base_dir, f"slot{slot}")
        os.mkdir(path, 0o700)
        if self.root:
            os.chown(path, UID_BASE + slot, UID_BASE + slot)
        return path

    def empty_slot_dir(self, slot: int) -> None:
        """Only where seccomp is off can a job leave anything behind (or, without chroot, remove its
        directory): start the slot afresh. A directory that cannot be made again fails that slot's next
        job at its set-up (exit code 72), never the server."""
        path = self.slot_dirs[slot]
        try:
            if not os.listdir(path):
                return
        except OSError:
            pass
        shutil.rmtree(path, ignore_errors=True)
        try:
            self.make_slot_dir(slot)
        except OSError:
            pass

    @staticmethod
    def address_space_in_use() -> int:
        """The server's own address space, which a child starts with: memory_mb is on top of it."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()

    def finish(self, child: Child) -> None:
        del self.children[child.pid]
        self.free_slots.append(child.slot)
        self.empty_slot_dir(child.slot)
        try:
            result = self.verdict(child)
        except Exception as e:  # noqa: BLE001  (a job must never take the server down with it)
            result = {"ok": False, "reason": f"the sandbox could not judge this job ({type(e).__name__}: {str(e)[:200]})",
                      "seccomp": self.seccomp.ctx is not None}
        result["output"] = child.out.decode("utf-8", errors="replace")
        result["seconds"] = round(time.monotonic() - child.started, 4)
        result["queued_s"] = round(child.started - child.job["received"], 4)
        self.send({"id": child.job["id"], "result": result})

    def verdict(self, child: Child) -> dict:
        """What happened, as data: ``ok`` and ``reason``, plus ``calls`` when the job ran to its end."""
        seccomp_on = self.seccomp.ctx is not None
        status = child.status
        if child.killed_for:
            return {"ok": False, "reason": child.killed_for, "seccomp": seccomp_on}
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            cpu = cpu_limit(child.job["timeout_s"])
            reason = SIGNAL_REASONS[sig].format(cpu=cpu) if sig in SIGNAL_REASONS else f"killed by signal {signal_name(sig)}"
            if sig == signal.SIGKILL:
                reason = f"killed (SIGKILL): the CPU-time hard limit of {cpu + 1} s or the kernel's OOM killer"
            return {"ok": False, "reason": reason, "seccomp": seccomp_on}
        code = os.WEXITSTATUS(status)
        if code == SECCOMP_FAILED:
            return {"ok": False, "reason": "the seccomp filter could not be loaded, so the code was not run",
                    "seccomp": False}
        if code != 0 or not child.result:
            return {"ok": False, "reason": f"exited with code {code} without a result", "seccomp": seccomp_on}
        data, why = check_result(bytes(child.result), len(child.job["calls"]))
        if data is None:
            return {"ok": False, "reason": f"the job's result was malformed: {why}", "seccomp": seccomp_on}
        filtered = data["seccomp"]
        if "error" in data:
            return {"ok": False, "reason": data["error"], "seccomp": filtered}
        calls = data["calls"]
        failed = next((i for i, c in enumerate(calls) if not c["ok"]), None)
        if failed is None:
            return {"ok": True, "reason": "", "calls": calls, "seccomp": filtered}
        return {"ok": False, "reason": f"call {failed + 1} raised {calls[failed]['error']}", "calls": calls, "seccomp": filtered}


def main() -> None:
    config = json.loads(sys.argv[1])
    Server(config).serve()


if __name__ == "__main__":
    main()
