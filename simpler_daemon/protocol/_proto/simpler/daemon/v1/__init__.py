"""Generated package; do not edit. Regenerate with ``python -m simpler_daemon.protocol.gen_proto``."""
