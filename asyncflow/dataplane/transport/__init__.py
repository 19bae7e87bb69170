"""The data plane's transports: ZeroMQ servers and clients, shared memory, wire formats."""
