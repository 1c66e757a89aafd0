"""Generated package; do not edit. Regenerate with ``python -m simpler_daemon.server.gen_proto``."""
