"""The top of slipstream: composes the stages into a run. `config` composes the stages' own configs into
RunConfig, `orchestration/` starts and heals the stages under Ray, `inspect` is the buffer's CLI.
Nothing in buffer/ or stages/ imports this package."""
