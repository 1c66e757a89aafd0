"""Endpoints: the transport under a lane (shared-memory mailbox, later framed TCP)."""
