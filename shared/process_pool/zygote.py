"""A pool's zygote: runs the pool's setup once (the imports, a tokenizer, a vocabulary), then
forks a helper from that state whenever the pool asks, in milliseconds. A helper killed at its
call's budget is replaced at once instead of after a new interpreter's imports and setup (3.5 s
for the grammar helper's imports alone on an idle 2-core machine, 10-20 s on a loaded one, while
the next client's grammar waited). The setup must leave no thread holding a lock a helper
needs: a fork copies only the forking thread (the grammar setup defers its compiler's creation
to the helper for this reason: grammar_trial.py).

Frames on stdin / stdout as a helper's (frames.py): ("setup", target, args) -> ("ok", None);
("fork", None, ()) -> ("ok", pid), with the helper's two pipe ends (its requests' write end,
its replies' read end) sent over the Unix socket the pool passed (SCM_RIGHTS).

    python -m shared.process_pool.zygote PARENT_PID SOCKET_FD"""
from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

from shared.process_pool.child import answer, exit_with_parent, quiet_stdout, serve
from shared.process_pool.frames import read_frame, write_frame


def fork_helper(state: Any, channel: socket.socket, own: list) -> int:
    """Fork a helper serving calls on two new pipes; send the pool its ends. Returns its pid."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:  # the helper: none of the zygote's channels, only its own pipes
        code = 1
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for f in own:
                f.close()
            channel.close()
            os.close(req_w)
            os.close(rep_r)
            exit_with_parent(zygote)  # the zygote exits with the pool: so do its helpers
            code = serve(os.fdopen(req_r, "rb"), os.fdopen(rep_w, "wb"), state)
        finally:
            os._exit(code)
    os.close(req_r)
    os.close(rep_w)
    try:
        socket.send_fds(channel, [b"h"], [req_w, rep_r])
    finally:
        os.close(req_w)
        os.close(rep_r)
    return pid


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a helper's (child.py): the pool decides when we stop
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # helpers that die (killed at a budget) are reaped for us
    exit_with_parent(int(sys.argv[1]))
    channel = socket.socket(fileno=int(sys.argv[2]))
    requests, replies = sys.stdin.buffer, quiet_stdout()
    state = None
    while True:
        try:
            kind, target, args = read_frame(requests)
        except EOFError:  # the pool closed our stdin: done
            return 0
        if kind == "fork":
            try:
                reply = ("ok", fork_helper(state, channel, [requests, replies]))
            except OSError as exc:
                reply = ("raise", RuntimeError(f"forking a helper: {exc}"))
        else:
            reply, state = answer(kind, target, args, state)
        write_frame(replies, reply)


if __name__ == "__main__":
    raise SystemExit(main())
