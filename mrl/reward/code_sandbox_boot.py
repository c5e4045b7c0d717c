"""Inside the sandbox (see `mrl.reward.code_sandbox`): prepare the scratch directory, drop to the
sandbox uid with rlimits, run the program, and exit with its status.

Run as `python -I -S code_sandbox_boot.py MODE UID SCRATCH JOB PYTHON CPU_S MEMORY_MB FILE_MB SCRATCH_MB PROCS FILES`.
Standard library only, no mrl imports: it starts in a fresh interpreter for every run. In the
namespace modes it is PID 1 of a new PID namespace: when it exits, the kernel kills every process
the program left behind.
"""
import os
import resource
import sys


def _mount_tmpfs(target: str, size_mb: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    flags = 0x2 | 0x4 | 0x8   # MS_NOSUID | MS_NODEV | MS_NOEXEC
    if libc.mount(b"tmpfs", target.encode(), b"tmpfs", flags, f"size={size_mb}m,mode=1777".encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def _only_writes_below(root: str) -> str | None:
    """Landlock: from now on this process and its children may create, write, remove or rename only
    below `root` (and write /dev/null). None when enforced, else why not."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    create, add, restrict = 444, 445, 446   # syscall numbers, the same on x86_64 and arm64
    abi = libc.syscall(create, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return "Landlock is not enabled"
    write_file, remove_dir, remove_file = 1 << 1, 1 << 4, 1 << 5
    make = sum(1 << b for b in range(6, 13))
    handled = write_file | remove_dir | remove_file | make | ((1 << 13) if abi >= 2 else 0) | ((1 << 14) if abi >= 3 else 0)

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    attr = ctypes.c_uint64(handled)
    ruleset = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        return "Landlock refused a ruleset"
    try:
        for path, rights in ((root, handled), ("/dev/null", write_file | ((1 << 14) if abi >= 3 else 0))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if libc.syscall(add, ruleset, 1, ctypes.byref(PathBeneath(rights, fd)), ctypes.c_uint32(0)) != 0:
                    return f"Landlock refused a rule for {path}"
            finally:
                os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(restrict, ruleset, 0) != 0:
            return "Landlock could not restrict the sandbox"
    finally:
        os.close(ruleset)
    return None


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
        for target in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.isdir(target):
                _mount_tmpfs(target, scratch_mb)
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    for name, data in sources.items():
        with open(os.path.join(scratch, name), "wb") as f:
            f.write(data)
    if mode in ("namespaces", "namespaces-no-mount"):
        for root, dirs, names in os.walk(scratch):
            for n in dirs + names:
                os.chown(os.path.join(root, n), uid, uid)
        os.chown(scratch, uid, uid)
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(scratch)
            if mode == "namespaces-no-mount":
                _only_writes_below(scratch)   # best effort: without Landlock the uid's permissions remain
            if mode in ("namespaces", "namespaces-no-mount"):
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
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
