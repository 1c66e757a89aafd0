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
TRANSPORT ``grpc-async`` / ``fast-async`` uses an ``AsyncClient`` (``register``,
``run``, ``close``, ``wait`` and ``exit`` only).
"""

from __future__ import annotations

import asyncio
import os
import sys

from simpler_daemon.client import AsyncClient, Client, sub_task, tensor


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


async def _ado(c: AsyncClient, command: str) -> None:
    verb, _, arg = command.partition(":")
    if verb == "register":
        print("hashid", await c.register(arg), flush=True)
    elif verb == "run":
        await c.run([sub_task(await c.register(arg))], timeout=60)
        print("ran", flush=True)
    elif verb == "close":
        await c.close()
        print("closed", flush=True)
    elif verb == "wait":
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            await _ado(c, line.strip())
    elif verb == "exit":
        sys.stdout.flush()
        os._exit(0)
    else:
        raise SystemExit(f"unknown command {command!r}")


async def amain(socket: str, transport: str, commands: list[str]) -> None:
    c = AsyncClient(socket, transport=transport, timeout=60)
    assert c.transport == transport, (c.transport, transport)
    for command in commands:
        await _ado(c, command)


def main() -> None:
    socket, transport, *commands = sys.argv[1:]
    if transport.endswith("-async"):
        asyncio.run(amain(socket, transport.removesuffix("-async"), commands))
        return
    if "LEASE_TOKEN" in os.environ:  # a host:port target: its token and CA
        c = Client(
            socket,
            token=os.environ["LEASE_TOKEN"],
            root_certificates=os.environ["LEASE_CA"],
            server_name="localhost",
            timeout=60,
        )
    else:
        c = Client(socket, transport=transport, timeout=60)
    assert c.transport == transport, (c.transport, transport)
    for command in commands:
        _do(c, command)


if __name__ == "__main__":
    main()
