"""The bottom of slipstream: the record it stores and the wire it serves (`record`: Sample and its Arrow
form; `wire`: the messages; `curve`, `net`: socket helpers), and the Arrow replay buffer built on them
(storage, durable segments, sampling policies, the ZeroMQ server and client). Imports nothing of
stages/ or pipeline/."""
