"""Shared memory with a child: the mailbox layout, the doorbell, and the C extension.

``layout.py`` is the one place frame offsets and states are named (the numbers come
from the extension and are checked at import); ``doorbell.py`` lets a child wake a
parked parent; ``_mailbox`` (``_mailbox*.c``, ``_mailbox.h``, typed by
``_mailbox.pyi``) does the atomics, futex waits and frame copies, and knows no policy.
"""
