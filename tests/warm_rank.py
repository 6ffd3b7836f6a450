"""`python -I -S warm_rank.py <address> <script> <args>`: stands in for `python <script> <args>` (or `python -m
<module> <args>`) when a run in the warm interpreter starts another process of itself (DDP's other ranks, a sweep's
job in a fresh process, a parallel sweep's joblib workers). The process is forked from tests/warm_server.py's
zygote, which has the imports already paid; this stand-in, with only the standard library and no site (about
20 ms), hands over its working directory, environment and every open file descriptor at its number (stdin, stdout,
stderr, the pipes joblib's workers are given), passes on every signal it gets, and ends as that process ends (the
same exit code, or killed by the same signal), so the run that started it sees no difference. If this stand-in is
killed outright, the zygote kills the process.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)


def open_fds(skip: int) -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == skip:
            continue
        try:
            os.fstat(fd)
        except OSError:  # the listing's own directory, closed since
            continue
        fds.append(fd)
    return sorted(fds)


def main() -> None:
    address, argv = sys.argv[1], sys.argv[2:]
    target: list[int] = []  # the real process's pid, once known
    pending: list[int] = []  # signals that came before it

    def forward(signum: int, _frame: object) -> None:
        if target:
            try:
                os.kill(target[0], signum)
            except ProcessLookupError:  # it has ended: its exit is on the way
                pass
        else:
            pending.append(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect("\0" + address)  # an abstract socket
    fds = open_fds(skip=conn.fileno())
    request = {"argv": [sys.executable, *argv], "cwd": os.getcwd(), "env": dict(os.environ), "fds": fds}
    socket.send_fds(conn, [json.dumps(request).encode()], fds)
    for fd in fds[3:]:  # the process holds them now: a pipe's end closes when it ends, not when this does
        os.close(fd)
    target.append(json.loads(conn.recv(4096))["pid"])
    for signum in pending:
        forward(signum, None)
    reply = conn.recv(4096)
    if not reply:
        print("warm_rank: the warm interpreter's zygote went away", file=sys.stderr)
        os._exit(1)
    code = json.loads(reply)["returncode"]
    if code < 0:  # killed by a signal: be killed by it too
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        signal.pause()
    os._exit(code)


if __name__ == "__main__":
    main()
