"""Inside the sandbox (see `mrl.reward.code_sandbox`): build the program's file system, prepare the
scratch directory, drop to the sandbox uid with rlimits, run the program, and exit with its status.

In the namespace modes the program's root is a fresh one (`_minimal_root`): the system's
read-only directories (/usr, /bin, /lib*, /etc) and the interpreter's prefix, bound read-only;
a fresh /proc of its own PID namespace; /dev with null, zero, full, random and urandom; and a
size-capped tmpfs at /tmp holding the scratch directory. Nothing else of the host is there: not
the run directory, the data, the host's /tmp, /run or /home (so no host unix socket; abstract
sockets belong to the network namespace), not other processes. `pivot_root` then detaches the
host's root, so no path leads back to it.

Run as `python -I -S code_sandbox_boot.py MODE UID SCRATCH JOB PYTHON CPU_S MEMORY_MB FILE_MB SCRATCH_MB PROCS FILES`.
Standard library only, no mrl imports: it starts in a fresh interpreter for every run. In the
namespace modes it is PID 1 of a new PID namespace: when it exits, the kernel kills every process
the program left behind.
"""
import os
import resource
import sys


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 0x400, 0x800, 0x1000, 0x4000, 1 << 18, 1 << 21
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
DEVICES = ("null", "zero", "full", "random", "urandom")


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    import ctypes

    enc = (lambda v: v.encode() if isinstance(v, str) else v)
    if _libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source or ''} on {target}: {os.strerror(err)}")


def _mount_tmpfs(target: str, size_mb: int, mode: str = "1777", flags: int = MS_NOSUID | MS_NODEV | MS_NOEXEC) -> None:
    _mount("tmpfs", target, "tmpfs", flags, f"size={size_mb}m,mode={mode}")


def _bind_read_only(source: str, target: str) -> None:
    """`source` at `target`, read-only (keeping the flags a user namespace locks on the source)."""
    _mount(source, target, None, MS_BIND | MS_REC)
    have = os.statvfs(target).f_flag
    keep = have & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME) | (MS_RELATIME if have & 4096 else 0)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)


def _prefixes(python: str) -> list[str]:
    """The install prefixes the interpreter needs (its own and its symlink target's), outside the
    system directories."""
    out = []
    for path in (os.path.abspath(python), os.path.realpath(python)):
        prefix = os.path.dirname(os.path.dirname(path))
        if prefix != "/" and prefix.split("/")[1] not in SYSTEM_DIRS and prefix not in out:
            out.append(prefix)
    return out


def _minimal_root(scratch_mb: int, python: str) -> None:
    """Make a fresh root of only what the program needs (see the module docstring) and pivot
    into it; afterwards /tmp is the capped scratch tmpfs."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)   # nothing below propagates to the host
    new = "/tmp"   # any directory serves as the mount point: the tmpfs hides what the host has there
    _mount_tmpfs(new, 1, "0755", MS_NOSUID | MS_NODEV)
    for name in SYSTEM_DIRS:
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(new, name))
        elif os.path.isdir(host):
            os.mkdir(os.path.join(new, name))
            _bind_read_only(host, os.path.join(new, name))
    for prefix in _prefixes(python):
        os.makedirs(new + prefix, exist_ok=True)
        _bind_read_only(prefix, new + prefix)
    os.mkdir(new + "/proc")
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(new + "/dev")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{new}/dev/{name}", "w").close()
            _mount("/dev/" + name, f"{new}/dev/{name}", None, MS_BIND)
    for link, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2")):
        os.symlink(to, f"{new}/dev/{link}")
    os.mkdir(new + "/tmp")
    _mount_tmpfs(new + "/tmp", scratch_mb)
    os.mkdir(new + "/.old")
    os.chdir(new)
    if _libc().syscall(155 if os.uname().machine == "x86_64" else 41, b".", b".old") != 0:   # pivot_root
        import ctypes

        raise OSError(ctypes.get_errno(), "pivot_root into the sandbox root failed")
    os.chdir("/")
    if _libc().umount2(b"/.old", 2) != 0:   # MNT_DETACH: the host's root is gone from this namespace
        raise OSError("cannot detach the host's root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _drop_capabilities() -> None:
    """No capabilities left for the program (user-namespace mode keeps uid 0 of its namespace):
    bounding set, then effective/permitted/inheritable, and no regaining them by exec."""
    import ctypes

    libc = _libc()
    libc.prctl(38, 1, 0, 0, 0)   # PR_SET_NO_NEW_PRIVS
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)   # PR_CAPBSET_DROP (EINVAL past the last capability)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _limit(which: int, value: int, hard_extra: int = 0) -> None:
    """Soft limit `value`, hard limit `value + hard_extra` (never above the current hard limit)."""
    hard = resource.getrlimit(which)[1]
    new_hard = value + hard_extra if hard == resource.RLIM_INFINITY else min(value + hard_extra, hard)
    resource.setrlimit(which, (min(value, new_hard), new_hard))


def main() -> int:
    mode, uid, scratch, job, python = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    cpu_s, memory_mb, file_mb, scratch_mb, procs, files = map(int, sys.argv[6:12])
    sources = {name: open(os.path.join(job, name), "rb").read() for name in os.listdir(job) if name != "scratch"}
    argv = sources.pop("argv").decode().split("\0")
    if mode in ("namespaces", "user-namespace"):
        _minimal_root(scratch_mb, python)
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    for name, data in sources.items():
        with open(os.path.join(scratch, name), "wb") as f:
            f.write(data)
    if mode == "namespaces":
        for root, dirs, names in os.walk(scratch):
            for n in dirs + names:
                os.chown(os.path.join(root, n), uid, uid)
        os.chown(scratch, uid, uid)
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(scratch)
            if mode == "namespaces":
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            elif mode == "user-namespace":
                _drop_capabilities()
            _limit(resource.RLIMIT_CPU, cpu_s, 1)   # SIGXCPU at the soft limit, SIGKILL a second later
            _limit(resource.RLIMIT_AS, memory_mb << 20)
            _limit(resource.RLIMIT_FSIZE, file_mb << 20)
            _limit(resource.RLIMIT_NPROC, procs)
            _limit(resource.RLIMIT_NOFILE, files)
            _limit(resource.RLIMIT_CORE, 0)
            os.environ["HOME"] = os.environ["TMPDIR"] = scratch
            os.execv(python, [python, "-I", *argv])
        except BaseException as e:  # noqa: BLE001 - reported as the run's stderr
            os.write(2, f"sandbox: {type(e).__name__}: {e}\n".encode())
        os._exit(127)
    if mode == "rlimits":
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return 127
        except InterruptedError:
            continue
    if mode == "rlimits":
        try:
            os.killpg(0, signal.SIGTERM)   # what the program left running in this session
        except OSError:
            pass
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    try:
        code = main()
    except Exception as e:  # noqa: BLE001 - a set-up failure: the parent reports it as "sandbox"
        os.write(2, f"sandbox: {type(e).__name__}: {e}\n".encode())
        code = 127
    sys.exit(code)
