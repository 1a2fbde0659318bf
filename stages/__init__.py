"""Pipeline stages: rollout generators, reward functions, the megatron trainer, weight transports."""
