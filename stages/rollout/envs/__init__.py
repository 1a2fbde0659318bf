"""Built-in rollout environments: generate_fns that run a multi-turn episode (docs/rollouts.md)."""
