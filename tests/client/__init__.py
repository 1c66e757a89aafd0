"""Clients: the Python client API, simplerctl and its run specs, and how a client finds the
daemon."""
