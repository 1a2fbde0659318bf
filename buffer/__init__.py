"""The Arrow replay buffer: storage, durable segments, sampling policies, ZeroMQ server and client."""
