"""The daemon API's bytes, shared by the client and the server.

``_proto/`` holds the generated gRPC stubs (``gen_proto.py`` regenerates them from
``protos/``); ``fastwire.py`` is the local fast path's frame codec and RPC table;
``framestream.py`` the decoder base both frame codecs (this one and the remote
wire's) build on; ``metadata.py`` the metadata keys both ends read; ``pbwire.py`` the
pieces of protobuf's wire format both ends write by hand.
"""
