"""The vocabulary and the mailbox: args, callables, the heap, the C extension, and what
importing the package loads."""
