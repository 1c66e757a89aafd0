"""A short-lived client process for the registration-lease tests (run as a script).

    python -m tests.support.lease_client SOCKET TRANSPORT COMMAND...

Commands run in order; each prints one line (flushed) when done:

    register:PATH          register in the client's session          -> "hashid <hashid>"
    persist:PATH           register with persist=True                 -> "hashid <hashid>"
    run:PATH               register PATH, run one empty task of it    -> "ran"
    hold:PATH              register PATH (wait_for_flag), submit a run of two tasks
                           waiting in turn on a new 2-byte flag buffer, not waiting
                           for it                                     -> "held <run> <buffer>"
    close                  Client.close()                             -> "closed"
    wait                   read stdin lines, each one more command, until EOF
    exit                   leave at once, the client neither closed nor collected

Without ``exit`` the script ends (its client unclosed) after the last command.
"""

from __future__ import annotations

import os
import sys

from simpler_daemon.client import Client, sub_task, tensor


def _do(c: Client, command: str) -> None:
    verb, _, arg = command.partition(":")
    if verb in ("register", "persist"):
        print("hashid", c.register(arg, persist=verb == "persist"), flush=True)
    elif verb == "run":
        c.run([sub_task(c.register(arg))], timeout=60)
        print("ran", flush=True)
    elif verb == "hold":
        wait = c.register(arg)
        flag = c.alloc_buffer((2,), "uint8").buffer_id
        ref = [tensor(flag, "inout", (2,), "uint8")]
        run = c.submit([sub_task(wait, ref, [60_000]), sub_task(wait, ref, [60_000])])
        print("held", int(run), flag, flush=True)
    elif verb == "close":
        c.close()
        print("closed", flush=True)
    elif verb == "wait":
        for line in sys.stdin:
            _do(c, line.strip())
    elif verb == "exit":
        sys.stdout.flush()
        os._exit(0)  # no close, no atexit, no garbage collection: the kernel ends it
    else:
        raise SystemExit(f"unknown command {command!r}")


def main() -> None:
    socket, transport, *commands = sys.argv[1:]
    c = Client(socket, transport=transport, timeout=60)
    assert c.transport == transport, (c.transport, transport)
    for command in commands:
        _do(c, command)


if __name__ == "__main__":
    main()
