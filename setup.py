"""Builds the one C extension; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "simpler_daemon.mailbox._mailbox",
            # One module, one concept per source file (see _mailbox.c's header comment).
            sources=[
                "simpler_daemon/mailbox/_mailbox.c",
                "simpler_daemon/mailbox/_mailbox_args.c",
                "simpler_daemon/mailbox/_mailbox_atomics.c",
                "simpler_daemon/mailbox/_mailbox_wait.c",
                "simpler_daemon/mailbox/_mailbox_frame.c",
                "simpler_daemon/mailbox/_mailbox_process.c",
                "simpler_daemon/mailbox/_mailbox_pump.c",
                "simpler_daemon/mailbox/_mailbox_gc.c",
            ],
            depends=["simpler_daemon/mailbox/_mailbox.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
    ]
)
